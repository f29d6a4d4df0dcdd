"""CIFAR-10 with DistributedDataParallel: data (generated or real), ResNet, training pieces, reports."""
