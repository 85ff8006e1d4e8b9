"""Whose fault an error in a worker is (issue 13, classification): pure, no processes.
The messages are the shapes torch 2.13 and NCCL give them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from unbroken.errors import ErrorClass, classify, classify_text, is_peer_error

NCCL_CUDA = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
             "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.26.2\n"
             "ncclUnhandledCudaError: Call to CUDA function failed.")
NCCL_REMOTE = ("NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a "
               "network error, NCCL version 2.26.2\nncclRemoteError: A call failed possibly due "
               "to a network error or a remote process exiting prematurely.")


@pytest.mark.parametrize("exc, own, expected", [
    # A peer died or left: the group broke under this worker, which survives.
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                  "peer [127.0.0.1]:1234"), None, ErrorClass.PEER),
    (dist.DistNetworkError("Connection reset by peer"), None, ErrorClass.PEER),
    (dist.DistBackendError(NCCL_REMOTE), 0, ErrorClass.PEER),
    (dist.DistBackendError("[Rank 1] Watchdog caught collective operation timeout: "
                           "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 ms"), 1,
     ErrorClass.PEER),
    # Its own device: the process must be replaced.
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), 0,
     ErrorClass.OWN_DEVICE),
    (RuntimeError("CUDA error: device-side assert triggered\nCompile with "
                  "`TORCH_USE_CUDA_DSA` to enable device-side assertions."), None,
     ErrorClass.OWN_DEVICE),
    (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"), 2,
     ErrorClass.OWN_DEVICE),
    (dist.DistBackendError(NCCL_CUDA), 0, ErrorClass.OWN_DEVICE),  # names no device: ours
    (dist.DistBackendError(NCCL_CUDA + " on cuda:1"), 1, ErrorClass.OWN_DEVICE),
    (dist.DistBackendError(NCCL_CUDA + " on cuda:3"), 1, ErrorClass.PEER),  # another's device
    # The script's own: as before.
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 0, ErrorClass.USER),
    (ValueError("bad batch"), None, ErrorClass.USER),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"), None,
     ErrorClass.USER),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage (run with "
                           "NCCL_DEBUG=WARN for details)\nncclInvalidUsage: This usually "
                           "reflects invalid usage of NCCL library."), 0, ErrorClass.USER),
    (KeyboardInterrupt(), None, ErrorClass.USER),
])
def test_errors_are_classified_by_whose_fault_they_are(exc, own, expected):
    assert classify(exc, own) == expected


def test_an_agent_classifies_an_error_record_the_same_way():
    assert classify_text("DistBackendError", NCCL_CUDA, None) == ErrorClass.OWN_DEVICE
    assert classify_text("RuntimeError", "Connection closed by peer", None) == ErrorClass.PEER
    assert classify_text("InjectedFault", "injected fault exception:rank=1,step=3") \
        == ErrorClass.USER


def test_a_peers_nccl_error_is_no_longer_every_nccl_error():
    """Before: any text with "NCCL" was a peer's fault, so a worker whose own device broke
    stayed in the job with a dead CUDA context."""
    assert not is_peer_error(dist.DistBackendError(NCCL_CUDA))
    assert is_peer_error(dist.DistBackendError(NCCL_REMOTE))
