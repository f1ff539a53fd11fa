// The chunked delta rule's kernel for avx2 (compiler flags in CMakeLists.txt); x86-64 only.
#if defined(__x86_64__)
#define MLX_TFM_ISA_AVX2
#define ISA_NAMESPACE avx2
#define ISA_LABEL "avx2"
#include "deltanet_body.inc"
#endif
