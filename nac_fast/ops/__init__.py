"""The NAC ops: the Python side of every kernel, one file per op (docs/math.md).

    dispatch.py   the one backend dispatcher (reference / cpu / triton / cuda) of every op
    reference.py  plain PyTorch: the oracle, fallback and baseline of the fused ops
    noise.py      the channel: scale s and the seeded Philox noise        kernels: csrc/nac_noise.cpp, nac_cuda.cu, kernels/nac_noise_triton.py
    nac.py        the fused NAC loss op: torch.library registration, autograd, fake impls
                                                                           kernels: csrc/nac_cpu.cpp, nac_cuda.cu, kernels/nac_triton.py
    loss.py       the public losses: nac_loss / nac_mq_loss / nac_vi_loss and the criteria
                  NACLoss / NACMQLoss (of the two views' outputs)
    queue.py      CodeQueue, the momentum codes of NAC-MQ (an nn.Module of buffers)
    momentum.py   NACMQ (MoCo's builder: momentum copy, queue, EMA, shuffle BN, criterion)
    collectives.py  all-gather with and without gradient, batch shuffle (identity in one process)
    codes.py      binary codes and their packed form (PackedCodes), the Hamming engine's input
    search.py     Hamming distances, top-k, full ranking                kernels: csrc/hamming.cpp, kernels/hamming_triton.py
    retrieval.py  retrieval scores: mAP@all, mAP@K, P@H<=r, PR curve, P@N (same kernels)
"""
