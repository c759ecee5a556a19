/* Forward MLX's three CBLAS calls to scipy-openblas32's prefixed symbols.
 * The mlx-cpu wheel on Linux links a reference (netlib) BLAS: ~3 GFLOP/s fp32 versus
 * ~180 through OpenBLAS (STACK.md). Loaded RTLD_GLOBAL before mlx, these definitions win
 * symbol lookup over the bundled libblas. */
typedef int I;
extern void scipy_cblas_sgemm(I, I, I, I, I, I, float, const float *, I, const float *, I, float, float *, I);
extern void scipy_cblas_dgemm(I, I, I, I, I, I, double, const double *, I, const double *, I, double, double *, I);
extern void scipy_cblas_cgemm(I, I, I, I, I, I, const void *, const void *, I, const void *, I, const void *, void *, I);

void cblas_sgemm(I o, I ta, I tb, I m, I n, I k, float al, const float *a, I la, const float *b, I lb,
                 float be, float *c, I lc) { scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, la, b, lb, be, c, lc); }
void cblas_dgemm(I o, I ta, I tb, I m, I n, I k, double al, const double *a, I la, const double *b, I lb,
                 double be, double *c, I lc) { scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, la, b, lb, be, c, lc); }
void cblas_cgemm(I o, I ta, I tb, I m, I n, I k, const void *al, const void *a, I la, const void *b, I lb,
                 const void *be, void *c, I lc) { scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, la, b, lb, be, c, lc); }
