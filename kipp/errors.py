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


class MissingExtra(KippError):
    """An optional package is not installed; the message names the extra that installs it."""

    def __init__(self, what: str, module: str, extra: str):
        self.module = module
        self.extra = extra
        super().__init__(f"{what} needs {module}, which is not installed: "
                         f"pip install 'kipp[{extra}]'{_ALTERNATIVE.get(extra, '')}")


# The extra that installs each optional top-level package (pyproject.toml's extras).
EXTRA_OF_MODULE = {
    "jax": "jax", "jaxlib": "jax", "mlx": "apple", "flask": "server", "waitress": "server",
    "prometheus_client": "server", "torch": "gates", "transformers": "gates",
    "llguidance": "structured", "jsonschema": "structured",
}
_ALTERNATIVE = {"jax": " (or 'kipp[cuda]' for an NVIDIA GPU)",
                "apple": " (off Apple silicon: pip install 'mlx[cpu]')"}


def require(module: str, what: str) -> None:
    """Raise MissingExtra naming the extra unless `module` is importable (nothing imported)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtra(what, module, EXTRA_OF_MODULE[module])


def missing_extra(error: ModuleNotFoundError, what: str) -> MissingExtra | None:
    """The MissingExtra for an import that failed on an optional package, else None."""
    root = (error.name or "").split(".")[0]
    return MissingExtra(what, root, EXTRA_OF_MODULE[root]) if root in EXTRA_OF_MODULE else None
