/* Glue of the backward kernels of index_scores_backward, indexer_kl_loss. */
#include "glue.h"

PyMethodDef csa_grad_index_methods[] = {
    {NULL, NULL, 0, NULL},
};
