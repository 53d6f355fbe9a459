"""The Hugging Face interop tests (tools/hf); common.py holds what they share."""
