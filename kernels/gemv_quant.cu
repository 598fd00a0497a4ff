// gemv_quant.cu: gemv.cu's kernels for compressed weights (W4A16, W8A16: pagedcli/model/quant.py), the
// gemvq4_ and gemvq8_ kernels, in a build of their own so that a model without such weights compiles
// none of them. Everything else is gemv.cu's: the same template, fusions and -D defines.
#define GEMV_QUANT
#include "gemv.cu"
