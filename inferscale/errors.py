"""Typed errors. Every error a user can cause names the thing that was wrong in one line."""


class InferScaleError(Exception):
    """Base class for every error InferScale raises on purpose."""


class ConfigError(InferScaleError):
    """A setting, flag or budget of the deployment is invalid (the operator's to fix, not the caller's)."""


class InvalidInputError(InferScaleError):
    """A value the caller passed is invalid: a name or id, a mode, a sampling or recompute value, an empty query.
    The server answers 400 with ``param`` when it is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(InferScaleError):
    """The model path is missing, unreadable or of an unsupported family."""


class MemoryItemError(InferScaleError):
    """A memory item is malformed: empty text, too long for the model, bad id."""


class BlobError(InferScaleError):
    """A KV blob cannot be used."""


class BlobCorruptError(BlobError):
    """A KV blob is unreadable, truncated or fails its checksum."""


class FingerprintMismatchError(BlobError):
    """A KV blob was encoded for another model (or another memory prefix)."""


class NotFoundError(InferScaleError):
    """A tenant, user or item does not exist (or is not visible to the caller)."""


class QuotaExceededError(InferScaleError):
    """A tenant's byte quota or a tier's budget cannot hold the request."""


class TransferError(InferScaleError):
    """A transfer between tiers or nodes failed or timed out."""


class PromptTooLongError(InferScaleError):
    """Prefix + memories + question + requested tokens exceed the model's context, or the K/V the server holds for all
    running requests (INFERSCALE_KV_CACHE_BYTES)."""


class StorageError(InferScaleError):
    """The node's disk tier cannot be written (full disk, permissions); no partial file is left behind."""


class BlobAuthError(BlobCorruptError):
    """A KV blob fails authentication under its tenant's key: forged, tampered, plain where a sealed one is
    required, moved to another tenant, user or item, or sealed under a key the KEK file does not hold."""


class UnsafePathError(InferScaleError):
    """A path argument names a place it may not: outside its tenant/user directory, or through a symlink."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBusyError(InferScaleError):
    """The engine cannot take the request now (its tenant's queue is full, or it waited past the queue timeout)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailableError(EngineBusyError):
    """The engine worker is not running (it died, or the server is shutting down): this replica answers nothing
    more; the client should retry, on another replica once this one is restarted."""


class UploadRefused(InferScaleError):
    """A Job's upload credential that is missing, malformed, forged or expired (inferscale/uploadtoken.py; 401)."""


class UploadDenied(InferScaleError):
    """A valid upload credential presented for a tenant or user it was not minted for (403)."""
