"""Inputs: the dataset reader and LoadGen's QSL (``dataset``), synthetic CNN-shaped data (``synthetic``),
re-tokenizing a dataset for another model (``retokenize``) and the SmolLM2 test model (``models_smollm2``)."""
