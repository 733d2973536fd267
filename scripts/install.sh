# Sourced by setup.sh and scripts/setup_*.sh: `install_into VENV ARGS...` installs ARGS into VENV's
# Python (pip's arguments: requirements, -e, -c, --no-deps, ...).
#
# It uses uv's pip when uv is at hand (.venv/bin/uv, made by `ensure_uv`, or uv on PATH) and pip
# otherwise. On CI's two cores uv sets up the six test environments in about half of pip's time:
# it downloads in parallel, unpacks each wheel once into its cache and links it into every
# environment that needs it (torch goes into four), and it does not compile every module to
# bytecode up front (Python does that on first import). The same requirements and pins hold; where
# a transitive dependency is left free, uv's resolver may take another version than pip's (seen:
# lm-eval's table writer), both valid. MOEPRUNE_INSTALLER=pip forces pip.
#
# uv does not read pip's configuration, so what pip would take from it is passed on: find-links
# folders, the index and extra indexes, the constraint file (this machine's pip.conf names
# /opt/wheels, where the CPU torch wheel lies, and caps torch), each only where it exists; and
# like pip, uv takes the best version over all indexes (uv's default is the first index that has
# the package).

_uv_path() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [ "${MOEPRUNE_INSTALLER:-}" = pip ]; then return 1; fi
  if [ -x "$root/.venv/bin/uv" ]; then echo "$root/.venv/bin/uv"; return 0; fi
  command -v uv 2>/dev/null
}

# pip's settings (configuration files and PIP_* variables) as uv's options.
_pip_settings_for_uv() {
  local py=${PYTHON:-python3} key value item config
  config=$("$py" -m pip config list 2>/dev/null || true)
  for key in find-links index-url extra-index-url constraint; do
    value=$(sed -n "s/^[a-z:]*\.$key='\(.*\)'$/\1/p" <<< "$config" | tr '\n' ' ')
    case $key in
      find-links) value="$value ${PIP_FIND_LINKS:-}" ;;
      index-url) value="$value ${PIP_INDEX_URL:-}" ;;
      extra-index-url) value="$value ${PIP_EXTRA_INDEX_URL:-}" ;;
      constraint) value="$value ${PIP_CONSTRAINT:-}" ;;
    esac
    for item in $value; do
      case $key in
        find-links) [ -d "$item" ] && echo "--find-links=$item" ;;
        index-url | extra-index-url) [ "${item#file://}" = "$item" ] || [ -d "${item#file://}" ] && echo "--$key=$item" ;;
        constraint) [ -f "$item" ] && echo "--constraint=$item" ;;
      esac
    done
  done | awk '!seen[$0]++'
}

install_into() {
  local venv=$1 uv
  shift
  if uv=$(_uv_path); then
    local settings
    mapfile -t settings < <(_pip_settings_for_uv)
    UV_INDEX_STRATEGY=${UV_INDEX_STRATEGY:-unsafe-best-match} UV_LINK_MODE=${UV_LINK_MODE:-hardlink} \
      "$uv" pip install -q --python "$venv/bin/python" "${settings[@]}" "$@"
  else
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
  fi
}

# .venv (made here if missing) with uv in it, by pip: one small wheel, seconds. Failing that, pip
# does every install as before.
ensure_uv() {
  local root py=${PYTHON:-python3}
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  [ -x "$root/.venv/bin/python" ] || "$py" -m venv "$root/.venv"
  if [ "${MOEPRUNE_INSTALLER:-}" != pip ] && [ ! -x "$root/.venv/bin/uv" ]; then
    "$root/.venv/bin/python" -m pip install -q --disable-pip-version-check uv \
      || echo "uv could not be installed: pip installs everything (slower)" >&2
  fi
}
