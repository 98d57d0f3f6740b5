// Strict syntax mode (clang only, -fsyntax-only): Metal's address spaces become clang address
// spaces, so handing a `constant` pointer to a `device` parameter, or a threadgroup pointer to a
// device one, is a type error as in Apple's compiler; and `double`, which Apple GPUs lack, is
// rejected. source.py keeps `threadgroup` arrays as `static threadgroup` declarations here.
#pragma once
#include "metal_emulator.h"
#undef device
#undef constant
#undef threadgroup
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define double metal_has_no_double
