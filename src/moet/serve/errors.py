"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Which status for what (docs/serve.md lists them):
  400 invalid_request_error  malformed JSON, a value the model cannot honour (tool_choice naming
                             an unknown tool, unsupported response_format / logit_bias,
                             max_tokens beyond the context left after the prompt)
  401 authentication_error   --api-key set and the Authorization header does not carry it
  400 invalid_request_error  also: wrong types / out-of-range values (pydantic's report, per field),
                             as OpenAI and vLLM answer them
  404 not_found_error        unknown model name or path, or no such route
  405 method_not_allowed     a route asked with the wrong method
  413 request_too_large      prompt longer than max_model_len, or a body over --max-request-bytes
  429 rate_limit_error       --max-pending-requests already in flight: retry later
  503 service_unavailable    the engine is shutting down or failed
  504 timeout_error          generation ran past --request-timeout-s (the request is aborted)
"""
from __future__ import annotations

from moet.serve.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code if self.code is not None else self.status))


class BadRequest(APIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(APIError):
    status, type = 401, "authentication_error"


class NotFound(APIError):
    status, type = 404, "not_found_error"


class MethodNotAllowed(APIError):
    status, type = 405, "method_not_allowed"


class TooLarge(APIError):
    status, type = 413, "request_too_large"


class Overloaded(APIError):
    status, type = 429, "rate_limit_error"


class Unavailable(APIError):
    status, type = 503, "service_unavailable"


class Timeout(APIError):
    status, type = 504, "timeout_error"
