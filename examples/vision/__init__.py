"""A torchvision model trained by fdp's recipe on images made of scikit-learn's digits (see ../README.md)."""
