// The int8-activation products with AVX-512 VNNI's vpdpbusd (compiler flags in
// CMakeLists.txt); x86-64 only. Used by the avx512 set where the CPU has VNNI.
#if defined(__x86_64__)
#define MLX_TFM_ISA_AVX512VNNI
#define ISA_NAMESPACE avx512vnni
#define ISA_LABEL "avx512vnni"
#include "int8dot_body.inc"
#endif
