// Float sums taken as written, never a * b + c fused into one rounding, where a result must equal another
// build's bit for bit (the PyTorch ops, the cuda_ext host build compiled with -ffp-contract=off). Functions
// between DFLASH_NO_CONTRACTION_BEGIN and _END that start with DFLASH_NO_CONTRACTION are compiled so under GCC
// and clang alike.
#pragma once

#if defined(__clang__)
#define DFLASH_NO_CONTRACTION _Pragma("clang fp contract(off)")
#define DFLASH_NO_CONTRACTION_BEGIN
#define DFLASH_NO_CONTRACTION_END
#else
#define DFLASH_NO_CONTRACTION
#define DFLASH_NO_CONTRACTION_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
#define DFLASH_NO_CONTRACTION_END _Pragma("GCC pop_options")
#endif
