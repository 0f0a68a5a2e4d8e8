"""``EngramLayout`` / ``NgramHashState`` as model.py uses them.

model.py calls ``EngramLayout.from_args(args)`` and treats None as "no engram layers";
otherwise it reads ``layer_ids``, ``num_embeddings``, ``head_dim``, ``max_ngram_size``
and ``n_heads`` from the layout and hashes token n-grams with ``NgramHashState``, whose
hashing scheme model.py does not show.  The stand-in gives the layout from the config's
``engram_*`` fields and refuses to build the hash state: the tests keep
``engram_layer_ids = ()``.
"""
from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class EngramLayout:
    layer_ids: Tuple[int, ...]
    num_embeddings: Tuple[int, ...]
    head_dim: int
    max_ngram_size: int
    n_heads: int

    @classmethod
    def from_args(cls, args):
        if not tuple(args.engram_layer_ids):
            return None
        return cls(tuple(args.engram_layer_ids), tuple(args.engram_num_embeddings),
                   args.engram_head_dim, args.engram_max_ngram_size, args.engram_n_heads)


class NgramHashState:
    def __init__(self, args, layout, tokenizer=None):
        raise NotImplementedError(
            "tests/v41_standins/engram.py: the n-gram hashing of the released V4.1 model is "
            "not published with model.py; build the model with engram_layer_ids=()")
