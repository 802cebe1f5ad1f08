"""Training: what train.py is built from (docs/math.md for the objectives).

    models.py      ResNet encoders, projection head and inference network (NACModel)
    methods.py     one step's loss for nac / nac-mq / simclr (on the public criteria and NACMQ of
                   nac_fast.ops), code statistics for the log
    lars.py        LARS with the authors' bug fixed (BN/bias excluded, zero-norm trust ratio 1)
    schedule.py    warm-up + cosine learning-rate schedule
    checkpoint.py  atomic checkpoints, exact resume, model loading for evaluation
    distributed.py DDP helpers: process group, SyncBN, rank-aware reductions
"""
