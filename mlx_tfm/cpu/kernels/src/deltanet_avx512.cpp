// The chunked delta rule's kernel for avx512 (compiler flags in CMakeLists.txt); x86-64 only.
#if defined(__x86_64__)
#define MLX_TFM_ISA_AVX512
#define ISA_NAMESPACE avx512
#define ISA_LABEL "avx512"
#include "deltanet_body.inc"
#endif
