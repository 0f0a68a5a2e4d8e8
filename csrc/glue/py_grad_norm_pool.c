/* Glue of the backward kernels of rms_norm_backward, gated_pool_backward. */
#include "glue.h"

PyMethodDef csa_grad_norm_pool_methods[] = {
    {NULL, NULL, 0, NULL},
};
