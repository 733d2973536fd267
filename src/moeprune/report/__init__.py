"""What a person reads beside every output: Markdown drawn from the JSON files (the contract)."""
