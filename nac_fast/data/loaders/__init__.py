"""Stage 4 of the data path: batches.  Each loader takes a source (stage 1), orders and shards it
with order.ShardedOrder (stage 2), makes the views with augment (stage 3), and yields
(view1, view2) tensors:

  tensor   TensorPretrainLoader, TensorEvalLoader: in-memory sources, batched tensor ops
  folder   FolderPretrainLoader, FolderEvalLoader: ImageFolders, PIL in DataLoader workers
  dali     DaliPretrainLoader: ImageFolders, an NVIDIA DALI pipeline on the CPU or the GPU

Every pretraining loader: len() = batches per epoch for this rank, set_epoch(epoch, start_batch),
iteration yields (view1, view2), attributes num_images, image_size, in_channels, num_classes and
skipped_files (the bad files it skipped so far: len() is the count).
"""
