"""Token types of an image span as model.py reads them: ``token_types >= 0`` marks image
positions (text is -1), and IMAGE / IMAGE_START / IMAGE_END / IMAGE_NEW_LINE tell the
span's slots apart in ``merge_image_embeddings``.  Distinct non-negative values."""
TEXT = -1
IMAGE = 0
IMAGE_START = 1
IMAGE_END = 2
IMAGE_NEW_LINE = 3
