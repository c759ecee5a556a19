"""The one error family of clawd.

Every error a user can cause or fix is a ClawdError whose message says what to do.
The edges convert it: the API into an OpenAI-style JSON error (status, type, code,
param), the CLI into one line on stderr and an exit code.
"""

from __future__ import annotations


class ClawdError(Exception):
    """Base class; `status` is the HTTP status the API answers with."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ClawdError):
    """The request is malformed or asks for something impossible (400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"

    def __init__(self, message: str):
        super().__init__(message, param="messages")


class AuthError(ClawdError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(ClawdError):
    """The request came from somewhere the daemon does not serve (a foreign Origin) (403)."""

    status = 403
    type = "invalid_request_error"
    code = "forbidden_origin"


class UnsupportedMediaType(ClawdError):
    """A body that is not JSON sent to a JSON endpoint (415)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Conflict(ClawdError):
    """The request would overwrite something that exists (409)."""

    status = 409
    type = "invalid_request_error"
    code = "already_exists"


class NotFound(ClawdError):
    status = 404
    type = "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str):
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it. "
            "GET /v1/models lists the models this daemon serves.",
            param="model",
        )


class Busy(ClawdError):
    """Temporarily unable to serve (engine restarting, adapter swapping): retry."""

    status = 503
    retry_after = 1


class Preempted(ClawdError):
    """Background engine work was stopped so a user request could run; retry later."""

    status = 503


class UpstreamUnavailable(ClawdError):
    """A service clawd was told to ask (Open WebUI's API) did not answer usefully."""

    status = 502
    code = "upstream_unavailable"


class ModelLoadError(ClawdError):
    """The model file is missing, unreadable or not a model llama.cpp can load."""


class AdapterError(ClawdError):
    """An adapter file is missing, corrupt or does not fit the loaded model."""

    status = 400
    type = "invalid_request_error"


class ConfigError(ClawdError):
    """config.toml, an environment variable or a flag has a bad value."""


class EngineError(ClawdError):
    """The engine failed while generating or scoring."""


class StorageFull(ClawdError):
    """The disk under the database is full: the turn could not be logged (507)."""

    status = 507
    code = "storage_full"


class StorageUnavailable(ClawdError):
    """The database cannot be written (read-only, I/O error): the turn could not be logged."""

    status = 503
    code = "storage_unavailable"
    retry_after = 5
