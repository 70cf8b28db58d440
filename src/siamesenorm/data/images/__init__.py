"""Image sets for the vision models: loaders, a stratified split, DeiT's augmentations, batches."""

from .augment import ImageAugment
from .batches import ImageBatchSampler, image_validation_batches
from .imageset import ImageSet, image_fingerprint, to_model_range
from .sources import check_image_options, load_images
from .split import split_images, stratified_split_indices

__all__ = ["ImageAugment", "ImageBatchSampler", "ImageSet", "check_image_options", "image_fingerprint",
           "image_validation_batches", "load_images", "split_images", "stratified_split_indices",
           "to_model_range"]
