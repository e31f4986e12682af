"""Models built from the layers: a classifier, a language model, a denoising
classifier."""
