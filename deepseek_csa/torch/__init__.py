"""PyTorch bridge: deepseek_csa kernels behind the call signatures of DeepSeek's released
``inference/model.py``, and ``swap`` / ``unswap`` to route chosen layers of a loaded model
through them one at a time.

    import deepseek_csa.torch as dct
    with dct.swap(model, layers=[2, 3]):          # a model.py Transformer, or Attention modules
        logits = model(tokens, 0)                 # layers 2 and 3 run on deepseek_csa
    dct.swap(model, ops=["sparse_attn"])          # only one op, every layer; dct.unswap(model)

Importing this package imports torch and registers the kernels as PyTorch operators,
``torch.ops.deepseek_csa.<name>`` (``ops``: schemas, fake kernels for torch.compile /
torch.export, autograd formulas); ``import deepseek_csa`` alone never imports torch.
Every function here runs through those operators.

Drop-in functions (same arguments and results as the released ones):
``sparse_attn``, ``apply_rotary_emb``, ``rms_norm`` / ``rms_norm_forward`` (RMSNorm.forward),
``act_quant`` / ``fp4_act_quant`` (their in-place QAT mode), ``rotate_activation``,
``get_window_topk_idxs``, ``get_compress_topk_idxs``, ``compressor_forward``
(Compressor.forward, V4 and V4.1), ``indexer_forward`` (V4 Indexer.forward) and
``indexer_forward_v41`` (V4.1 Indexer.forward, with its shared index keys and candidate
blocks).

Tensors: CPU float32 tensors are handed to the kernels as NumPy views of the same memory
(no copies; in-place ops write into the caller's tensor) and results come back as tensors
over the kernels' output buffers (``torch.from_numpy``, no copy).  bfloat16 tensors go to
the kernels as they are, too: ``rms_norm``, ``apply_rotary_emb``, ``sparse_attn``,
``act_quant`` / ``fp4_act_quant`` (in place), ``rotate_activation`` and the indexer's
scoring read and write bf16 with no copies, float32 inside and one rounding where the
released model rounds.  The Compressor pools in float32, as the released one does (it
widens x before its projections).

How ``swap`` routes a layer: the chosen ``Attention`` modules get an instance ``forward``
that runs the module's own ``forward`` while the model module's op functions
(``sparse_attn``, ``apply_rotary_emb``, ``act_quant``, ``fp4_act_quant``,
``rotate_activation``, ``get_window_topk_idxs``, ``get_compress_topk_idxs``) point at the
drop-ins for the ops selected, and the layer's ``RMSNorm``, ``Compressor`` and ``Indexer``
submodules get the drop-in forwards (the V4 or the V4.1 indexer drop-in, told apart by
the released ``forward`` signatures: V4.1's takes the layer's ``latent``).  ``swap``
returns which ops it routed per layer (``Swap.routed``) and warns, naming the module,
when a requested op found nothing it could route.  Projections stay the module's own (so FP8 weights
keep working) and the caches stay in the module's buffers, in the module's layout, so a
layer can be swapped or unswapped between decode steps.  The per-head query
normalisation, written inline in the released ``Attention.forward``, stays torch.
Not thread-safe: the op functions are patched in the model's module for the duration of a
swapped layer's forward.

The package's modules: ``dropins`` (the released-signature functions), ``swap`` (routing a
loaded model through them), ``kernel_module`` (the released ``kernel`` module on the CPU),
``ops`` (the operators), ``autograd`` (the differentiable functions without a released
counterpart), ``compressor_grad`` (the differentiable Compressor.forward), ``quantized`` (``FP8Linear`` / ``FP4Experts``: projections over the
released FP8 / FP4 weights, for inference), ``checkpoint_width`` (the runner's weights read at
the width the checkpoint stores them: ``wo_a`` as FP8, float32 weights as bf16), ``_tensors``
(bringing arguments to the kernels' dtypes).
"""
from . import ops  # noqa: F401  (registers torch.ops.deepseek_csa)
from .dropins import *  # noqa: F401,F403
from .dropins import _ORIG  # noqa: F401  (the model's own functions, kept by swap)
from .swap import OPS, Swap, _attention_modules, swap, unswap  # noqa: F401
from .kernel_module import install_kernels, load_model_py  # noqa: F401
from .autograd import *  # noqa: F401,F403
from .quantized import fp4_weight, fp8_weight  # noqa: F401
from . import autograd as _autograd, dropins as _dropins, quantized as _quantized

__all__ = (["OPS", "swap", "unswap", "Swap"] + _dropins.__all__
           + ["load_model_py", "install_kernels"] + _autograd.__all__ + _quantized.__all__)


def __getattr__(name):
    # FP8Linear / FP4Experts are nn.Modules, made when first asked for (torch stays lazy)
    if name in ("FP8Linear", "FP4Experts"):
        return getattr(_quantized, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
