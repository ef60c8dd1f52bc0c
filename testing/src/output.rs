//! What a program prints, searched for a secret the way a log aggregator would find it: run a
//! binary ([`capture`], [`example`]), then look for the secret in every form it can take in the
//! output ([`find_secret`], [`assert_hidden`]).
//!
//! The forms ([`forms`]) are the secret as typed; percent-encoded (as a URL parser or builder
//! writes it back); base64 (as an encoded credential, at each alignment it can have inside a
//! longer encoded text); its bytes as `Debug` prints a byte buffer (`[75, 120, 57, …]`, as
//! lapin logs an AMQP SASL response) and as hex; and each long piece of it between the
//! characters a parser splits an unencoded secret at (`/`, `?`, `#`, `&`, `@`, `:`, `,`, `;`,
//! `=`, whitespace), since a parser that cuts a secret in two can echo one half.

use std::io::Read as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Pieces shorter than this are not searched: they are too likely to occur in any output.
pub const MIN_PIECE: usize = 6;

/// One form of a secret: how it was derived, and the text to look for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Form {
    /// E.g. `plain`, `percent-encoded`, `base64 (offset 1)`, `piece`.
    pub name: String,
    /// The text that must not occur in the output.
    pub text: String,
}

/// Every form of `secret` [`find_secret`] looks for (see the module docs), without duplicates.
pub fn forms(secret: &str) -> Vec<Form> {
    let mut out: Vec<Form> = Vec::new();
    let mut add = |name: &str, text: String| {
        if !text.is_empty() && !out.iter().any(|f| f.text == text) {
            out.push(Form {
                name: name.to_owned(),
                text,
            });
        }
    };
    add("plain", secret.to_owned());
    for (name, keep) in [
        ("percent-encoded", UNRESERVED),
        ("percent-encoded (alphanumerics kept)", ALPHANUMERIC),
    ] {
        let encoded = percent_encode(secret, keep);
        add(name, encoded.clone());
        add(name, encoded.to_lowercase_hex());
    }
    for offset in 0..3 {
        if let Some(b64) = base64_inner(secret.as_bytes(), offset) {
            add(&format!("base64 (offset {offset})"), b64.clone());
            add(
                &format!("base64url (offset {offset})"),
                b64.replace('+', "-").replace('/', "_"),
            );
        }
    }
    let bytes = secret.as_bytes();
    add(
        "bytes (Debug)",
        bytes.iter().map(u8::to_string).collect::<Vec<_>>().join(", "),
    );
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    add("hex", hex.clone());
    add("hex", hex.to_uppercase());
    for piece in secret.split(|c: char| SPLITS.contains(&c) || c.is_whitespace()) {
        if piece.len() >= MIN_PIECE && piece != secret {
            add("piece", piece.to_owned());
        }
    }
    out
}

/// Where `output` shows `secret`, in any of its [`forms`]: the form's name and the line it is
/// on; `None` when it shows none of them.
pub fn find_secret(output: &str, secret: &str) -> Option<String> {
    forms(secret).into_iter().find_map(|form| {
        let at = output.find(&form.text)?;
        let line_start = output[..at].rfind('\n').map_or(0, |i| i + 1);
        let line_end = output[at..].find('\n').map_or(output.len(), |i| at + i);
        Some(format!(
            "{} form {:?} in: {}",
            form.name,
            form.text,
            &output[line_start..line_end]
        ))
    })
}

/// Panics, naming `what`, the form found and the line, if `output` shows `secret` in any of
/// its [`forms`].
#[track_caller]
pub fn assert_hidden(what: &str, output: &str, secret: &str) {
    if let Some(found) = find_secret(output, secret) {
        panic!("{what} shows the secret {secret:?}: {found}\n--- whole output ---\n{output}");
    }
}

/// Everything a program printed, and how it ended.
#[derive(Debug, Clone)]
pub struct Captured {
    /// The exit code; `None` when it was killed (see `stopped`) or died by a signal.
    pub code: Option<i32>,
    /// Whether [`capture`] killed it (its `until` text appeared, or the time ran out).
    pub stopped: bool,
    /// Standard output, lossily decoded.
    pub stdout: String,
    /// Standard error, lossily decoded.
    pub stderr: String,
}

impl Captured {
    /// stdout and stderr together, for searching.
    pub fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// Runs `cmd` (stdin closed, stdout and stderr captured) until it exits; or, with `until`,
/// until its output shows that text; or until `timeout`. A program still running then is
/// killed, and `stopped` says so. Returns everything it printed.
pub fn capture(cmd: &mut Command, until: Option<&str>, timeout: Duration) -> Captured {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let drain = |mut from: Box<dyn std::io::Read + Send>| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let sink = buffer.clone();
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = from.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        (buffer, reader)
    };
    let (stdout, out_reader) = drain(Box::new(child.stdout.take().expect("piped")));
    let (stderr, err_reader) = drain(Box::new(child.stderr.take().expect("piped")));
    let shown = |b: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&b.lock().unwrap()).into_owned();
    let started = Instant::now();
    let mut stopped = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break Some(status);
        }
        let seen = until.is_some_and(|text| shown(&stdout).contains(text) || shown(&stderr).contains(text));
        if seen || started.elapsed() >= timeout {
            stopped = true;
            // This child only, by its handle: never a process group or a name.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // A process the child started may still hold the pipes open: wait for the readers a
    // little, then take what they have.
    let readers_done = Instant::now();
    while !(out_reader.is_finished() && err_reader.is_finished())
        && readers_done.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    Captured {
        code: status.and_then(|s| s.code()),
        stopped,
        stdout: shown(&stdout),
        stderr: shown(&stderr),
    }
}

/// The example binary `name` that cargo built beside the running test binary
/// (`target/<profile>/examples/<name>`; `cargo test --workspace` builds every example first).
/// `None`, with a message, when it is not there; under CI (`CI` set) that is a failure.
pub fn example(name: &str) -> Option<PathBuf> {
    // target/<profile>/deps/<test>-<hash> → target/<profile>/examples/<name>
    let exe = std::env::current_exe().expect("the test's own path");
    let path = exe.parent()?.parent()?.join("examples").join(name);
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the example {name} is not built at {} (cargo test --workspace builds it)",
        path.display()
    );
    eprintln!(
        "SKIPPED: the example {name} is not built at {} (cargo build --workspace --examples)",
        path.display()
    );
    None
}

/// Characters an unencoded secret is split at by the parsers it passes through.
const SPLITS: &[char] = &['/', '?', '#', '&', '@', ':', ',', ';', '='];
/// Bytes percent-encoding keeps as they are (RFC 3986 unreserved).
const UNRESERVED: &[u8] = b"-._~";
/// Percent-encoding that keeps only letters and digits (as sqlx writes a password back).
const ALPHANUMERIC: &[u8] = b"";

fn percent_encode(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

trait LowerHex {
    fn to_lowercase_hex(&self) -> String;
}

impl LowerHex for String {
    /// `%2F` → `%2f`, everything else unchanged.
    fn to_lowercase_hex(&self) -> String {
        let mut out = String::with_capacity(self.len());
        let mut hex_left = 0;
        for c in self.chars() {
            if c == '%' {
                hex_left = 2;
                out.push(c);
            } else if hex_left > 0 {
                hex_left -= 1;
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }
}

/// The part of the base64 encoding of `secret` that does not depend on what surrounds it when
/// it starts `offset` bytes (0, 1 or 2) after a multiple of three in a longer encoded text;
/// `None` when that part is shorter than four characters.
fn base64_inner(secret: &[u8], offset: usize) -> Option<String> {
    let mut bytes = vec![0u8; offset];
    bytes.extend_from_slice(secret);
    let encoded = base64(&bytes);
    // Characters whose 6 bits all come from the secret's bytes.
    let start = (8 * offset).div_ceil(6);
    let end = 8 * (offset + secret.len()) / 6;
    (end >= start + 4).then(|| encoded[start..end].to_owned())
}

/// Standard base64 without padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_reference_encoding() {
        assert_eq!(base64(b"Man"), "TWFu");
        assert_eq!(base64(b"Ma"), "TWE");
        assert_eq!(base64(b"M"), "TQ");
        assert_eq!(base64(b"\0guest\0s3cret"), "AGd1ZXN0AHMzY3JldA");
    }

    #[test]
    fn a_secret_is_found_inside_a_longer_base64_text_at_every_alignment() {
        let secret = "Kx9-Secret-Tail";
        for prefix in ["", "a", "ab", "abc", "\0user\0"] {
            let text = format!("{prefix}{secret}!?");
            let encoded = base64(text.as_bytes());
            assert!(
                find_secret(&format!("response: {encoded}"), secret).is_some(),
                "{prefix:?}: {encoded}"
            );
        }
    }

    #[test]
    fn percent_encoded_forms_and_pieces_are_found() {
        let secret = "Kx9/Secret-Tail";
        for shown in [
            "postgres://u:Kx9%2FSecret-Tail@h",
            "postgres://u:Kx9%2fSecret%2dTail@h",
            "invalid value 'Secret-Tail'",
            "Kx9/Secret-Tail",
            // lapin's trace of the AMQP StartOk frame: `\0user\0password` as a Debug byte list.
            "response: LongString([0, 103, 117, 101, 115, 116, 0, 75, 120, 57, 47, 83, 101, 99, \
             114, 101, 116, 45, 84, 97, 105, 108])",
            "4b78392f5365637265742d5461696c",
        ] {
            assert!(find_secret(shown, secret).is_some(), "{shown}");
        }
        for clean in ["postgres://u:***@h", "Kx9", "Secret"] {
            assert_eq!(find_secret(clean, secret), None, "{clean}");
        }
    }

    #[test]
    fn capture_returns_the_output_and_stops_at_the_marker() {
        let done = capture(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            None,
            Duration::from_secs(10),
        );
        assert_eq!((done.code, done.stopped), (Some(3), false), "{done:?}");
        assert_eq!((done.stdout.trim(), done.stderr.trim()), ("out", "err"));
        let stopped = capture(
            Command::new("sh").args(["-c", "echo ready; exec sleep 30"]),
            Some("ready"),
            Duration::from_secs(10),
        );
        assert!(stopped.stopped && stopped.code.is_none(), "{stopped:?}");
    }
}
