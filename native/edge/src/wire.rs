//! What routing reads of a SendMessageRequest, scanned from its wire bytes (``lmq_broker.protocol.wire.routes``):
//! each message's parent topic (``Message.topic.name``) and lite topic (``Message.system_properties.lite_topic``),
//! without building protobuf objects. Python calls it only on bytes protobuf's own parser has already accepted;
//! anything this scanner does not read the way protobuf does (a group, a field it cannot follow) gives None, and
//! Python reads the decoded request instead (the plain twin, tested against this on the same inputs).

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

const REQUEST_MESSAGES: u64 = 1; // SendMessageRequest.messages
const MESSAGE_TOPIC: u64 = 1; // Message.topic (Resource)
const MESSAGE_SYSTEM_PROPERTIES: u64 = 3; // Message.system_properties
const RESOURCE_NAME: u64 = 2; // Resource.name
const LITE_TOPIC: u64 = 21; // SystemProperties.lite_topic (optional: its presence is a lite message's mark)
const LEN: u64 = 2; // wire type: length-delimited

fn varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf.get(*pos)?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// The next field of ``buf`` from ``pos``: (number, wire type, its bytes when length-delimited). None at a group
/// or anything malformed.
fn field<'a>(buf: &'a [u8], pos: &mut usize) -> Option<(u64, u64, &'a [u8])> {
    let tag = varint(buf, pos)?;
    let (number, kind) = (tag >> 3, tag & 7);
    let start = *pos;
    let end = match kind {
        0 => {
            varint(buf, pos)?;
            return Some((number, kind, &buf[start..start]));
        }
        1 => start.checked_add(8)?,
        LEN => {
            let len = usize::try_from(varint(buf, pos)?).ok()?;
            let begin = *pos;
            let end = begin.checked_add(len)?;
            if end > buf.len() {
                return None;
            }
            *pos = end;
            return Some((number, kind, &buf[begin..end]));
        }
        5 => start.checked_add(4)?,
        _ => return None, // groups (3, 4): not in these messages; protobuf would have kept them as unknown fields
    };
    if end > buf.len() {
        return None;
    }
    *pos = end;
    Some((number, kind, &buf[start..start]))
}

/// The last value of string field ``number`` in ``buf`` (a later occurrence wins, as protobuf merges), into ``out``.
fn last_string<'a>(buf: &'a [u8], number: u64, out: &mut Option<&'a [u8]>) -> Option<()> {
    let mut pos = 0;
    while pos < buf.len() {
        let (n, kind, value) = field(buf, &mut pos)?;
        if n == number && kind == LEN {
            *out = Some(value);
        }
    }
    Some(())
}

/// (parent, lite topic or None) of one Message's bytes. A message field that occurs twice is merged by protobuf,
/// its later fields winning: reading every occurrence in order, the last value seen is protobuf's.
fn message_route(buf: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let mut name: Option<&[u8]> = None;
    let mut lite: Option<&[u8]> = None;
    let mut pos = 0;
    while pos < buf.len() {
        let (n, kind, value) = field(buf, &mut pos)?;
        if kind != LEN {
            continue;
        }
        match n {
            MESSAGE_TOPIC => last_string(value, RESOURCE_NAME, &mut name)?,
            MESSAGE_SYSTEM_PROPERTIES => last_string(value, LITE_TOPIC, &mut lite)?,
            _ => {}
        }
    }
    Some((name.unwrap_or(b""), lite))
}

pub(crate) fn routes_of(data: &[u8]) -> Option<(&[u8], Vec<&str>)> {
    let mut parent: Option<&[u8]> = None;
    let mut lites = Vec::new();
    let mut pos = 0;
    while pos < data.len() {
        let (n, kind, value) = field(data, &mut pos)?;
        if n != REQUEST_MESSAGES || kind != LEN {
            continue;
        }
        let (name, lite) = message_route(value)?;
        match parent {
            None => parent = Some(name),
            Some(p) if p != name => return None, // several parents: the plain reading sorts them out
            Some(_) => {}
        }
        lites.push(std::str::from_utf8(lite?).ok()?); // a message that is not a lite one: the plain reading too
    }
    Some((parent?, lites))
}

/// ``(parent, [lite topic of each message])`` of a SendMessageRequest's bytes when every message is a lite
/// message (its ``lite_topic`` present) of one parent; None otherwise (no message, several parents, a message
/// that is not a lite one, or bytes this scanner does not follow).
#[pyfunction]
pub fn send_routes<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Option<(Bound<'py, PyString>, Bound<'py, PyList>)>> {
    let Some((parent, lites)) = routes_of(data) else { return Ok(None) };
    let Ok(parent) = std::str::from_utf8(parent) else { return Ok(None) };
    let list = PyList::empty(py);
    for lite in lites {
        list.append(PyString::new(py, lite))?;
    }
    Ok(Some((PyString::new(py, parent), list)))
}
