"""Stock transformers loads every moeprune-format result through the folder's modeling_moeprune.py,
on a machine without moeprune.

A module fixture makes every family in every kind of result that a stock config cannot express
(per-layer expert counts as from `global`/`evo`, novices, TENP's per-expert widths, one uniform
width that stays non-stock) with moeprune's own surgery and saver, and records
`moeprune.load_pretrained`'s logits. Then ONE fresh interpreter (`python -I`, a clean sys.path,
and `sys.modules["moeprune"] = None`, so any hidden import of moeprune fails loudly) loads every
folder with `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`, computes its
logits, and checks that stock transformers refuses each folder without `trust_remote_code`.
The tests below only read what that run recorded. Logits are compared with the suite's fp32
reordering tolerance (tests/helpers.py); on this machine they were bit-identical.

MOEPRUNE_SERVE_TEST_PATH=DIR[:DIR...] puts other packages first on the child's sys.path, to run
the same checks against another transformers (the vLLM environments pin 5.16.1 to 5.19).
"""

from __future__ import annotations

import ast
import copy
import filecmp
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_observe import calibration
from transformers import AutoModelForCausalLM

import moeprune
from helpers import REORDER_RTOL, assert_logits_close
from moeprune.checkpoint.save import moeprune_config
from moeprune.checkpoint.structure import family_record
from moeprune.criteria import compute_scores
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.observe.observer import observe
from moeprune.plan import LayerPlan, Plan
from moeprune.serve.modeling_moeprune import MODELING_FILES as modeling_files
from moeprune.surgery.plans import apply_plan_physical
from moeprune.surgery.tenp import tenp_plan

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

MODELING = Path(moeprune.__file__).parent / "serve" / "modeling_moeprune.py"
MODELING_FILES = [MODELING.parent / name for name in modeling_files]  # the entry file and what it imports
TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
KINDS = ("counts", "novice", "tenp", "uniform12")
EXTRA = ("llama4_text-uniform8", "qwen3_moe-sharded-tied", "deepseek_v3-bf16", "deepseek_v3-bf16-as-fp32",
         "mixtral-hub-cache")  # fmt: skip
# One per expert layout and name mapping: fused per-expert names, Mixtral's and ERNIE's renames,
# gpt_oss's interleaved biases, Llama-4's input weighting.
RESAVED = ("qwen3_moe-tenp", "mixtral-novice", "ernie4_5_moe-novice", "gpt_oss-tenp", "llama4_text-novice")
BF16_RTOL = 1e-2  # bf16 weights and activations on both sides: a coarse but real check
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


# ----------------------------------------------------------------------------- making results
def uneven_removal(moe: MoEModel) -> dict[int, list[int]]:
    """Different expert counts per layer; group-limited routers lose one expert from each group;
    layers kept whole (hash routing) lose none."""
    removed: dict[int, list[int]] = {}
    for j, layer in enumerate(moe.layers):
        if layer.fixed:
            removed[layer.index] = []
        elif layer.n_group > 1:
            size = layer.num_experts // layer.n_group
            removed[layer.index] = [] if j == 0 else [g * size for g in range(layer.n_group)]
        else:
            removed[layer.index] = [0, 5, 6][: 1 + j % 3]
    return removed


def make_result(family: str, kind: str, stats=None, **overrides):
    """A pruned tiny model of `family` that a stock config cannot express."""
    model = tiny_model(family, **overrides)
    moe = MoEModel(model)
    if kind == "counts":  # as from --allocation global / evo
        drop_experts(moe, uneven_removal(moe))
        return model
    if kind == "novice":  # MoNE novices, plus uneven drops
        removed = uneven_removal(moe)
        layers = []
        for m in moe.layers:
            kept = [e for e in range(m.num_experts) if e not in removed[m.index]]
            novices = [e for e in (1, 3, 6) if e in kept][: 1 + m.index % 2]
            layers.append(LayerPlan(layer=m.index, num_experts=m.num_experts, top_k=m.top_k, kept=kept,
                                    dropped=removed[m.index], novice=novices))  # fmt: skip
        plan = Plan.create(model_type=family, layers=layers, criterion="manual", allocation="global",
                           method="novice", sparsity=0.25)  # fmt: skip
    elif kind == "tenp":  # TENP: whole important experts, the rest with their own neuron counts
        plan = tenp_plan(moe, stats, compute_scores("tenp", stats=stats), 0.5)
    else:  # one width for every expert that the stock config cannot hold ("uniform12", "uniform8")
        width = int(kind.removeprefix("uniform"))
        layers = [
            LayerPlan(layer=m.index, num_experts=m.num_experts, top_k=m.top_k, kept=list(range(m.num_experts)),
                      neurons=dict.fromkeys(range(m.num_experts), width))
            for m in moe.layers
        ]  # fmt: skip
        plan = Plan.create(model_type=family, layers=layers, criterion="manual", allocation="uniform",
                           method="neurons", sparsity=0.25)  # fmt: skip
    apply_plan_physical(moe, plan, stats)
    return model


def reference_logits(path: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return moeprune.load_pretrained(path, dtype=dtype)(TOKENS).logits.float()


def save(model, path: Path, **kwargs) -> Path:
    assert moeprune.save_pretrained(model, path, **kwargs) == "moeprune", (
        f"{path.name} saved as a stock checkpoint"
    )
    for source in MODELING_FILES:
        assert filecmp.cmp(path / source.name, source, shallow=False), f"the saver did not copy {source.name}"
    return path


def _stats(family: str):
    moe = MoEModel(tiny_model(family))
    return observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)


def build_cases(root: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Every output folder, what the child does with it, and moeprune's logits for it."""
    cases, refs = [], {}

    def loads(name: str, path: Path, reference: torch.Tensor, **kwargs) -> None:
        cases.append({"name": name, "path": str(path), "kwargs": kwargs, "expect": "load"})
        refs[name] = reference.contiguous()

    for family in supported_families():
        stats = _stats(family)
        kinds = KINDS + (("uniform8",) if family == "llama4_text" else ())  # Llama-4: any width is non-stock
        for kind in kinds:
            path = save(make_result(family, kind, stats), root / f"{family}-{kind}")
            loads(path.name, path, reference_logits(path))

    for name in RESAVED:
        next(c for c in cases if c["name"] == name)["resave"] = str(root / f"{name}-resaved")

    tied = make_result("qwen3_moe", "novice", _stats("qwen3_moe"), tie_word_embeddings=True)
    path = save(tied, root / "qwen3_moe-sharded-tied", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    loads(path.name, path, reference_logits(path))

    path = save(
        make_result("deepseek_v3", "tenp", _stats("deepseek_v3")), root / "deepseek_v3-bf16", dtype="bf16"
    )
    loads(path.name, path, reference_logits(path, torch.bfloat16))  # dtype "auto": the saved bf16
    loads("deepseek_v3-bf16-as-fp32", path, reference_logits(path), dtype="float32", device_map="cpu")

    # A Hub repository already in the local cache (the layout huggingface_hub reads), loaded by id.
    cache = root / "hub-cache"
    repo = cache / "models--moeprune-test--tiny-mixtral"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    snapshot = repo / "snapshots" / HUB_COMMIT
    snapshot.parent.mkdir()
    source = root / "mixtral-novice"
    os.symlink(source, snapshot)
    cases.append({"name": "mixtral-hub-cache", "path": "moeprune-test/tiny-mixtral", "expect": "load",
                  "kwargs": {"cache_dir": str(cache), "local_files_only": True}})  # fmt: skip
    refs["mixtral-hub-cache"] = refs["mixtral-novice"]

    cases.extend(broken_cases(root, root / "olmoe-novice"))
    return cases, refs


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def broken_cases(root: Path, good: Path) -> list[dict]:
    """Damaged folders and unsupported arguments: each must fail with an error naming the problem."""
    missing = _copy(good, root / "broken-missing")
    tensors = load_file(missing / "model.safetensors")
    gone = next(name for name in tensors if name.endswith(".up_proj.weight") and ".experts." in name)
    del tensors[gone]
    save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})

    unexpected = _copy(good, root / "broken-unexpected")
    tensors = load_file(unexpected / "model.safetensors")
    extra = "model.layers.0.mlp.experts.99.mean_output"
    tensors[extra] = torch.zeros(32)
    save_file(tensors, str(unexpected / "model.safetensors"), metadata={"format": "pt"})

    edited = _copy(good, root / "broken-structure")
    config = json.loads((edited / "config.json").read_text())
    config["moeprune"]["layers"][0]["widths"].pop()
    (edited / "config.json").write_text(json.dumps(config))

    def fails(name, path, message, **kwargs):
        return {"name": name, "path": str(path), "kwargs": kwargs, "expect": "error", "message": message}

    return [
        fails("missing tensor", missing, ["missing tensors", gone]),
        fails("unexpected tensor", unexpected, ["unexpected tensors", extra]),
        fails("damaged structure", edited, ["layer 0", "widths"]),
        fails("device_map auto", good, ["device_map='auto'"], device_map="auto"),
        fails("quantization", good, ["load_in_8bit"], load_in_8bit=True),
    ]


# ----------------------------------------------------------------------------- the child
CHILD = r"""
import json, os, sys, time
# Another transformers to test against (a `pip install --target DIR transformers==5.16.1`, say):
sys.path[:0] = [p for p in os.environ.get("MOEPRUNE_SERVE_TEST_PATH", "").split(os.pathsep) if p]
sys.modules["moeprune"] = None  # a hidden `import moeprune` raises ImportError
try:
    import moeprune  # noqa: F401
    blocked = False
except ImportError:
    blocked = True
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


torch.set_num_threads(1)
manifest = json.load(open(sys.argv[1]))
tokens = torch.tensor(manifest["tokens"])
results, logits = {}, {}
start = time.time()
for case in manifest["cases"]:
    entry = results.setdefault(case["name"], {})
    try:
        model = AutoModelForCausalLM.from_pretrained(case["path"], trust_remote_code=True, **case["kwargs"])
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
        continue
    entry["class"] = type(model).__name__
    entry["module"] = type(model).__module__
    entry["config"] = type(model.config).__name__
    entry["config_class"] = type(model).config_class.__name__
    entry["training"] = model.training
    entry["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    entry["fp32"] = sorted(n for n, t in model.state_dict().items() if t.dtype == torch.float32)
    with torch.no_grad():
        logits[case["name"]] = model(tokens).logits.float().contiguous()
    if case.get("resave"):  # the loaded model saves itself in the same format
        model.save_pretrained(case["resave"])
        again = AutoModelForCausalLM.from_pretrained(case["resave"], trust_remote_code=True)
        with torch.no_grad():
            logits[case["name"] + " resaved"] = again(tokens).logits.float().contiguous()
    entry["untrusted"] = []
    for extra in ({}, {"trust_remote_code": False}):  # stock transformers must refuse both ways
        try:
            other = AutoModelForCausalLM.from_pretrained(case["path"], **extra, **case["kwargs"])
            entry["untrusted"].append(f"returned a {type(other).__name__}")
        except Exception as exc:
            entry["untrusted"].append(f"{type(exc).__name__}: {exc}")
imported = sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "moeprune" and m is not None)
summary = {"blocked": blocked, "moeprune_modules": imported, "transformers": transformers.__version__,
           "seconds": time.time() - start}
json.dump({"summary": summary, "cases": results}, open(sys.argv[2], "w"))
save_file(logits, sys.argv[3])
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_transformers")
    cases, refs = build_cases(root)
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"tokens": TOKENS.tolist(), "cases": cases}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(root / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-I", "-c", CHILD, str(manifest), str(root / "results.json"), str(root / "logits.safetensors")],
        cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"the child failed:\n{run.stderr[-4000:]}"
    results = json.loads((root / "results.json").read_text())
    for name in RESAVED:  # what the loaded model saved, moeprune loads too
        refs[f"{name} resaved by moeprune"] = reference_logits(root / f"{name}-resaved")
    return {
        "summary": results["summary"],
        "cases": {c["name"]: {**c, **results["cases"][c["name"]]} for c in cases},
        "logits": load_file(str(root / "logits.safetensors")),
        "refs": refs,
    }


# ----------------------------------------------------------------------------- the tests
def _loaded(served, name: str) -> dict:
    case = served["cases"][name]
    assert "error" not in case, f"{name}: {case['error']}"
    return case


def test_the_child_never_imported_moeprune(served):
    summary = served["summary"]
    assert summary["blocked"], (
        "moeprune was importable in the child: the test would not notice a hidden import"
    )
    assert summary["moeprune_modules"] == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", supported_families())
def test_auto_model_loads_every_family_and_kind_like_moeprune(served, family, kind):
    name = f"{family}-{kind}"
    case = _loaded(served, name)
    causal_lm, config = _causal_lm(family)
    own = causal_lm.config_class.__name__
    # a family running another family's causal LM (5.24's sarvam_*) gets one class per pair
    pair = "" if own == config.__name__ else f"__{config.__name__}"
    assert case["class"] == f"MoePrune{causal_lm.__name__}{pair}"
    assert case["config_class"] == case["config"] == f"MoePrune{config.__name__}"
    assert case["module"].startswith("transformers_modules.") and case["module"].endswith(
        ".modeling_moeprune"
    )
    assert case["training"] is False
    assert case["dtypes"] == ["torch.float32"]
    assert_logits_close(served["logits"][name], served["refs"][name], rtol=REORDER_RTOL)


def _causal_lm(family: str) -> tuple[type, type]:
    """The stock class a result of `family` is built on (its causal LM, or its multimodal wrapper),
    and the family's config class, which need not be that class's own."""
    from moeprune.models.classes import model_class
    from moeprune.models.factory import tiny_config

    config = tiny_config(family)
    return model_class(config), type(config)


@pytest.mark.parametrize("name", ["llama4_text-uniform8", "qwen3_moe-sharded-tied", "mixtral-hub-cache"])
def test_other_outputs_load_like_moeprune(served, name):
    """Llama-4 with a multiple-of-8 width (its shared expert's width follows the same config
    field, so no stock config holds it), shards with an index and tied embeddings, and a Hub
    repository already in the local cache, loaded by its id."""
    _loaded(served, name)
    assert_logits_close(served["logits"][name], served["refs"][name], rtol=REORDER_RTOL)


@pytest.mark.parametrize("name", RESAVED)
def test_a_loaded_model_saves_a_folder_both_loaders_read(served, name):
    expected = served["refs"][name]
    assert_logits_close(served["logits"][f"{name} resaved"], expected, rtol=REORDER_RTOL)
    assert_logits_close(served["refs"][f"{name} resaved by moeprune"], expected, rtol=REORDER_RTOL)


def test_dtype_auto_keeps_the_saved_bf16_and_float32_can_be_asked_for(served):
    bf16 = _loaded(served, "deepseek_v3-bf16")
    # what stock keeps in fp32 at bf16 stays fp32, as stock keeps it: the selection bias, and from
    # transformers 5.24 the router weight too (DeepseekV3's _keep_in_fp32_modules_strict)
    strict = list(transformers.DeepseekV3ForCausalLM._keep_in_fp32_modules_strict or [])
    kept = {pattern: re.compile(rf"(^|\.){re.escape(pattern)}$") for pattern in strict}
    assert "torch.bfloat16" in bf16["dtypes"] and set(bf16["dtypes"]) <= {"torch.bfloat16", "torch.float32"}
    assert all(any(k.search(n) for k in kept.values()) for n in bf16["fp32"]), bf16["fp32"]
    assert strict and all(any(k.search(n) for n in bf16["fp32"]) for k in kept.values()), bf16["fp32"]
    assert_logits_close(
        served["logits"]["deepseek_v3-bf16"], served["refs"]["deepseek_v3-bf16"], rtol=BF16_RTOL
    )
    fp32 = _loaded(served, "deepseek_v3-bf16-as-fp32")
    assert fp32["dtypes"] == ["torch.float32"]
    name = "deepseek_v3-bf16-as-fp32"
    assert_logits_close(served["logits"][name], served["refs"][name], rtol=REORDER_RTOL)


def _loadable(served) -> list[str]:
    return [name for name, case in served["cases"].items() if case["expect"] == "load"]


def test_stock_transformers_refuses_every_output_without_trust_remote_code(served):
    names = _loadable(served)
    assert len(names) == len(supported_families()) * len(KINDS) + len(EXTRA)
    for name in names:
        case = _loaded(served, name)
        for outcome in case["untrusted"]:
            assert not outcome.startswith("returned"), f"{name}: stock transformers {outcome} without trust"
            assert "trust_remote_code" in outcome, f"{name}: refused for another reason: {outcome[:300]}"


@pytest.mark.parametrize("name", ["missing tensor", "unexpected tensor", "damaged structure", "device_map auto",
                                  "quantization"])  # fmt: skip
def test_damaged_folders_and_unsupported_arguments_fail_clearly(served, name):
    case = served["cases"][name]
    assert "error" in case, f"{name}: loaded instead of failing"
    assert "modeling_moeprune:" in case["error"], case["error"]
    for fragment in case["message"]:
        assert fragment in case["error"], f"{name}: {fragment!r} not in {case['error']!r}"


# ----------------------------------------------------------------------------- the file itself
@functools.cache
def _modeling_module():
    """The modeling files by themselves, as a package of their own (as transformers loads them)."""
    folder = Path(tempfile.mkdtemp()) / "modeling_under_test"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for source in MODELING_FILES:
        shutil.copyfile(source, folder / source.name)
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module("modeling_under_test.modeling_moeprune")


def test_legacy_family_table_agrees_with_discovery():
    """Results saved before config.json carried the family record load through the modeling
    file's own table; for those families it must say what discovery writes into the record."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    _modeling_module()
    table = importlib.import_module("modeling_under_test.moeprune_families").FAMILIES
    for base, row in table.items():
        model = tiny_model(base)
        record = family_record(MoEModel(model))
        ours = (row.block_attr, row.router_attr, row.count_field, row.intermediate_field, row.layout,
                [list(t) for t in row.router_tensors], list(row.count_attrs),
                list(row.disk_expert_names) if row.disk_expert_names else None, row.weight_on_input)  # fmt: skip
        theirs = tuple(record[k] for k in ("block_attr", "router_attr", "count_field", "intermediate_field",
                                           "layout", "router_tensors", "count_attrs", "disk_expert_names",
                                           "weight_on_input"))  # fmt: skip
        assert ours == theirs, base

        def renamed(name: str, renames) -> str:
            for old, new in renames:
                name = name.replace(old, new)
            return name

        names = list(model.state_dict())  # the renames may be spelled apart but must agree on every name
        assert [renamed(n, row.disk_renames) for n in names] == [
            renamed(n, record["disk_renames"]) for n in names
        ]
        assert record["block_tensors"] == []
        assert record["own_gate"] == (row.layout == "interleaved")  # gpt_oss's clamped SwiGLU is its own
        assert row.config_class == CONFIG_MAPPING[base].__name__ == record["config_class"]
        assert row.causal_lm_class == _causal_lm(base)[0].__name__ == record["causal_lm_class"]


def test_a_result_without_the_family_record_loads_through_the_table(tmp_path):
    """A folder written before the record existed (the record removed by hand) loads the same."""
    path = save(make_result("mixtral", "novice", _stats("mixtral")), tmp_path / "old")
    expected = reference_logits(path)
    config = json.loads((path / "config.json").read_text())
    del config["moeprune"]["family"]
    (path / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_close(model(TOKENS).logits, expected)


def test_every_family_defines_the_classes_the_saver_names(tmp_path):
    """config.json's auto_map names MoePrune + the stock class names; each resolves in the file, and
    the model class's config_class is the config's (transformers refuses them otherwise)."""
    module = _modeling_module()
    for base in supported_families():
        model = make_result(base, "counts")
        data = moeprune_config(MoEModel(model), copy.deepcopy(model.config))
        for ref in data["auto_map"].values():
            cls = getattr(module, ref.split(".", 1)[1])
            assert cls.__module__ == module.__name__
        config_class = getattr(module, data["auto_map"]["AutoConfig"].split(".")[1])
        assert config_class.model_type == data["model_type"] == f"moeprune_{base}"
        model_class = getattr(module, data["auto_map"]["AutoModelForCausalLM"].split(".")[1])
        assert model_class.config_class is config_class
        stock = type(model)  # architectures: the causal LM (vLLM's plugin registers MoePrune + its name)
        assert issubclass(model_class, stock) and data["architectures"] == [f"MoePrune{stock.__name__}"]
        if stock.config_class is type(model.config):
            assert model_class.__name__ == f"MoePrune{stock.__name__}"


def test_a_causal_lm_run_on_another_familys_config_gets_a_class_of_its_own():
    """Some families run another family's causal LM on a config class of their own (transformers
    5.24's sarvam_mla: DeepseekV3ForCausalLM on SarvamMLAConfig). transformers refuses a remote
    model class whose config_class is named unlike the config's, so the file makes one class per
    (causal LM, config) pair; shown here on two families every supported transformers has."""
    module = _modeling_module()
    plain = module.MoePruneDeepseekV3ForCausalLM
    pair = module.MoePruneDeepseekV3ForCausalLM__Glm4MoeConfig
    assert plain.config_class is module.MoePruneDeepseekV3Config
    assert (
        pair.config_class is module.MoePruneGlm4MoeConfig
        and pair.config_class.model_type == "moeprune_glm4_moe"
    )
    assert pair is not plain and issubclass(pair, transformers.DeepseekV3ForCausalLM)
    assert getattr(module, pair.__name__) is pair  # built once
    with pytest.raises(AttributeError, match="has no NoSuchConfig; upgrade transformers"):
        _ = module.MoePruneDeepseekV3ForCausalLM__NoSuchConfig
    with pytest.raises(AttributeError):  # a causal LM is no config class
        _ = module.MoePruneDeepseekV3ForCausalLM__Glm4MoeForCausalLM


@pytest.mark.parametrize("source", MODELING_FILES, ids=lambda p: p.name)
def test_modeling_files_import_only_torch_transformers_the_standard_library_and_each_other(source):
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "safetensors", "huggingface_hub"}
    tree = ast.parse(source.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
    }
    assert imported <= allowed, sorted(imported - allowed)
    # relative imports reach the sibling files only: transformers copies exactly those with the entry file
    siblings = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
    assert all(
        isinstance(n, ast.ImportFrom) and n.level == 1 for n in ast.walk(tree) if getattr(n, "level", 0)
    )
    assert {f"{name}.py" for name in siblings} <= {p.name for p in MODELING_FILES}, siblings
