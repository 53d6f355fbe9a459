"""Interop with Hugging Face `transformers`: model directories in (`import_hf`) and out
(`export_hf`). The name and shape mapping of each architecture is data (`architectures.py`);
the tensors are read and written by `weights.py`, the tokenizers by `tokenizer_files.py`;
`convert.py` does the rest in one function per direction. Needs the hf extra (transformers'
libraries: safetensors, tokenizers)."""

from transformer_jax.tools.hf.convert import export_hf, import_hf  # noqa: F401
