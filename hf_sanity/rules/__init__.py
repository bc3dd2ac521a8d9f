"""Rule modules. Each declares its rules with `hf_sanity.catalog.define` next to the code that detects them."""
