/* The CPU kernels' library: decode steps, verification and drafting of a small fp32 Llama-family
 * model on CPU, called through ctypes from specops/kernels/cpu_linear.py and the wrapper
 * modules beside it.
 *
 * One translation unit (this file is what specops/kernels/cbuild.py compiles, and its hash
 * covers every file included here): the layer stack's calls inline across the files, exactly
 * as when they were one file, and each file's static helpers stay private to the library.
 *   gemv.c       y = f(x) W^T (+ b) (+ residual) over panel-packed weights (gemv.h)
 *   attention.c  attention over a dense cache or a block-paged store, rotary (attention.h)
 *   pool.c       the persistent thread pool the two above split their rows over (pool.h)
 *   layers.c     whole forwards of a layer stack, and drafting loops over them (layers.h)
 *   sample.c     argmax rows, softmax and inverse-CDF draws (sample.h)
 *   verify.c     verification of a drafted block in one call (steps.h)
 *   medusa.c     Medusa proposals and one greedy Medusa step in one call (steps.h)
 * kernel.h holds what they all share (system headers, instruction-set macros, vexp.h).
 */
#include "gemv.c"
#include "attention.c"
#include "pool.c"
#include "layers.c"
#include "sample.c"
#include "verify.c"
#include "medusa.c"
