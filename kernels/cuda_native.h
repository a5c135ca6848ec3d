// The CUDA handles behind the backend's types (kernels/cuda/), for code outside kernels/ that runs
// CUDA work of its own beside the ops (the device communicator, parallel/nccl_comm.h) or tells
// GPUs apart. Names no CUDA type; defined in a build with the CUDA backend only.
#pragma once

#include <string>

namespace t3d::kernels::cuda {

class Stream;

// The cudaStream_t of `stream`: a device communicator records events on it and makes it wait on
// its own, so that its transfers are ordered with the ops.
void* native_stream(const Stream& stream);

// The index (cudaSetDevice's) of the GPU `stream` runs on.
int stream_device(const Stream& stream);

// The PCI bus id of the GPU `stream` runs on ("0000:1b:00.0"): what tells two ranks they share
// one GPU, also where each sees it under another index (CUDA_VISIBLE_DEVICES).
std::string pci_bus_id(const Stream& stream);

}  // namespace t3d::kernels::cuda
