// The int8-activation products with AVX2's maddubs (compiler flags in CMakeLists.txt);
// x86-64 only. Used by the avx2 set, and by the avx512 set where the CPU lacks VNNI.
#if defined(__x86_64__)
#define MLX_TFM_ISA_AVX2
#define ISA_NAMESPACE avx2
#define ISA_LABEL "avx2"
#include "int8dot_body.inc"
#endif
