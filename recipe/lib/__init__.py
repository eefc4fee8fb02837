"""The recipe's library: data dirs and Kaldi I/O, corpora, features, datasets, targets, decoding, config."""
