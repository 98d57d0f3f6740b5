"""Kipp's exceptions: every rejection names what was wrong."""


class KippError(Exception):
    """Base class of every error Kipp raises on purpose."""


class RegistryError(KippError):
    """A checkpoint id, revision or registry field is not what the registry pins."""


class ArtifactError(KippError):
    """A GGUF artifact failed validation; `field` names the offending part."""

    def __init__(self, path, field, message):
        self.path = str(path)
        self.field = field
        super().__init__(f"{self.path}: {field}: {message}")


class FieldMismatch(ArtifactError):
    """A metadata field or tensor property differs from what the registry entry requires."""

    def __init__(self, path, field, expected, found):
        self.expected = expected
        self.found = found
        super().__init__(path, field, f"expected {expected!r}, found {found!r}")


class DownloadError(KippError):
    """A checkpoint could not be fetched or verified at its pinned revision."""


class QuantError(KippError):
    """Bad input to a weight quantizer or dequantizer."""


class ConvertError(KippError):
    """A source checkpoint folder cannot be converted into a Kipp artifact."""
