//! The HTTP answer of every operation: its JSON body, or the error mapped to its status (the one
//! mapping of an [`ApiError`] to HTTP; [`super::grpc::status_of`] is gRPC's).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::json::error_body;
use super::{Api, ApiError};

/// An error as its HTTP answer: status, `{"error": ..}` body, and the headers it calls for.
pub fn error_response(e: &ApiError) -> Response {
    let (status, field) = match e {
        ApiError::Invalid(inv) => (StatusCode::BAD_REQUEST, Some(inv.field.as_str())),
        ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, None),
        ApiError::AdminOff => (StatusCode::NOT_FOUND, None),
        ApiError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, None),
        ApiError::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, None),
        ApiError::Overloaded(_)
        | ApiError::StreamBusy(_)
        | ApiError::BufferFull(_)
        | ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, None),
    };
    let field = field.filter(|f| !f.is_empty());
    let mut resp = (status, Json(error_body(e.code(), field, &e.message()))).into_response();
    if matches!(e, ApiError::Unauthenticated) {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if e.closes_connection() {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// An operation's answer as HTTP, counted under the `http` transport.
pub fn answer<T: serde::Serialize>(api: &Api, result: Result<T, ApiError>) -> Response {
    match result {
        Ok(d) => {
            api.metrics.request("http", "ok");
            json_response(&d)
        }
        Err(e) => {
            api.metrics.request("http", e.code());
            error_response(&e)
        }
    }
}

/// `d` as a 200 JSON answer. Written into one buffer sized for a take's answer, with a `Vec`'s
/// writer (axum's `Json` starts at 128 bytes, which a take's answer outgrows, through a slower
/// writer); a value that cannot be serialized falls back to `Json`'s own 500.
fn json_response<T: serde::Serialize>(d: &T) -> Response {
    let mut body = Vec::with_capacity(256);
    match serde_json::to_writer(&mut body, d) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(_) => Json(d).into_response(),
    }
}
