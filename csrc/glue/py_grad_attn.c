/* Glue of the backward kernels of sparse attention: sparse_attn_backward, sparse_attn_weights. */
#include "glue.h"

PyMethodDef csa_grad_attn_methods[] = {
    {NULL, NULL, 0, NULL},
};
