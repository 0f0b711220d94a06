// The part of torch's C++ API that Tandem's CPU kernels use: tensors, two factory ops, at::parallel_for and
// the pybind11 casters for each module's bindings. common/kernels/build.py puts this file first in every
// kernel module. <torch/extension.h> would bring torch's whole C++ frontend (nn, optim, autograd, data
// loaders) that no kernel uses, and compiling it takes about 2.5 times as long (docs/cpu-kernels.md).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/Exceptions.h>  // torch::wrap_pybind_function_no_gil

namespace torch {
using namespace at;  // torch::Tensor, torch::empty, torch::kInt..., as <torch/types.h> names them
}  // namespace torch
