"""CPU stand-ins for the modules DeepSeek's released V4.1 ``inference/model.py`` imports
relatively but that are not published with it (``kernel_cpu``, ``engram``, ``vision``,
``image_processor``).  Written for the tests from what model.py calls (names, argument
lists, what it does with the results), not from the unpublished files:

* ``kernel_cpu``: the six kernels, on deepseek_csa's CPU kernel module where its
  signature matches (deepseek_csa.torch.kernel_module), the GEMMs with V4.1's 32-wide
  activation blocks by dequantizing in float32;
* ``engram``: ``EngramLayout.from_args`` (None when the config has no engram layers, the
  only case the tests build) and an ``NgramHashState`` that refuses to be built;
* ``vision``: ``ViT`` / ``Aligner`` that refuse to be built (the tests keep
  ``vision_n_layers = 0``);
* ``image_processor``: the token-type constants (text is -1, image spans >= 0).

``released_files.load_v41`` imports the released file with these in place.
"""
