"""Models built from the layers: a classifier, a language model, a denoising
classifier."""

from ._classifier import SequenceClassifier as SequenceClassifier
from ._denoising import DenoisingClassifier as DenoisingClassifier
from ._language_model import LanguageModel as LanguageModel
