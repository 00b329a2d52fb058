"""The default model's name and the dtypes a model may be asked for, importable without torch.

``kvviz --help`` builds every subcommand's options from these; importing :mod:`kvviz.models` for them
cost the command line seconds of torch and transformers before it could print a word.
"""

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = ("float32", "bfloat16", "float16")  # the dtypes a model may be asked for by name
