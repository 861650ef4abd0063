// One part of a stacked output (stacked_matrix.py: q, k and v kept in their own formats, writing
// one q|k|v): output row o of input row r goes to y[r * Y_STRIDE + Y_OFFSET + o]; by default the
// matrix's own [n_rows, out_rows]. Included by the quant GEMV kernels (gemv_quant.cl, gemv_quant_wg.cl).
#ifndef Y_OFFSET
#define Y_OFFSET 0
#endif
#ifndef Y_STRIDE
#define Y_STRIDE out_rows
#endif
