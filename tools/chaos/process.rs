//! Ledger child processes: start with a crash point armed, kill, stop gracefully, and tell how
//! they ended.

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How to start the ledger.
pub struct Launcher {
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    logs: PathBuf,
    started: u32,
    /// `RUST_LOG` for the children unless `CHAOS_LEDGER_LOG` says otherwise.
    log_filter: String,
    /// Arguments given in turn, one per child (the n-th child gets the n-th, round and round).
    rotating: Vec<String>,
}

impl Launcher {
    /// `binary` with `args`; each child's stdout and stderr go to a file under `logs`.
    pub fn new(binary: PathBuf, args: Vec<String>, logs: PathBuf) -> anyhow::Result<Launcher> {
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        Ok(Launcher {
            binary,
            args,
            env: Vec::new(),
            logs,
            started: 0,
            log_filter: "info".into(),

            rotating: Vec::new(),
        })
    }

    /// Sets an environment variable for every ledger: URLs with passwords go there rather
    /// than on command lines, where `ps` shows them.
    pub fn env(&mut self, key: &str, value: &str) {
        self.env.push((key.to_owned(), value.to_owned()));
    }

    /// Adds an argument for every child started from now on.
    pub fn arg(&mut self, arg: String) {
        self.args.push(arg);
    }

    /// Replaces the argument that starts with `prefix` (e.g. `--group=`) for every child
    /// started from now on.
    pub fn replace_arg(&mut self, prefix: &str, arg: String) {
        self.args.retain(|a| !a.starts_with(prefix));
        self.args.push(arg);
    }

    /// The children's `RUST_LOG` (default `info`; `CHAOS_LEDGER_LOG` wins).
    pub fn log_filter(&mut self, filter: &str) {
        self.log_filter = filter.to_owned();
    }

    /// Gives each child one of `args` in turn (the first child the first); none: nothing.
    pub fn rotate(&mut self, args: Vec<String>) {
        self.rotating = args;
    }

    /// Where the children's logs are.
    pub fn logs(&self) -> &Path {
        &self.logs
    }

    /// How many children were started.
    pub fn started(&self) -> u32 {
        self.started
    }

    /// Starts one ledger, with `TXINBOX_CRASH_AT=crash_at` if given, as consumer
    /// `consumer_name`.
    pub fn start(
        &mut self,
        label: &str,
        crash_at: Option<&str>,
        consumer_name: &str,
    ) -> anyhow::Result<Ledger> {
        self.started += 1;
        let log = self.logs.join(format!("{:02}-{label}.log", self.started));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .arg(format!("--consumer-name={consumer_name}"))
            .env(
                "RUST_LOG",
                std::env::var("CHAOS_LEDGER_LOG").unwrap_or_else(|_| self.log_filter.clone()),
            )
            .env_remove(txinbox::crash::ENV)
            // Errors are reported by their messages; backtraces would bury them in the logs.
            .env("RUST_LIB_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true);
        if let Some(point) = crash_at {
            command.env(txinbox::crash::ENV, point);
        }
        if !self.rotating.is_empty() {
            let arg = &self.rotating[(self.started as usize - 1) % self.rotating.len()];
            command.arg(arg);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let pid = Pid::from_raw(child.id().context("a just started child has a pid")? as i32);
        Ok(Ledger {
            child,
            pid,
            log,
            started: Instant::now(),
        })
    }
}

/// A running ledger.
pub struct Ledger {
    child: tokio::process::Child,
    pid: Pid,
    log: PathBuf,
    started: Instant,
}

impl Ledger {
    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Time since it was started.
    pub fn age(&self) -> Duration {
        self.started.elapsed()
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Sends SIGKILL and waits for the exit.
    pub async fn kill(&mut self) -> anyhow::Result<ExitStatus> {
        let _ = kill(self.pid, Signal::SIGKILL);
        Ok(self.child.wait().await?)
    }

    /// Sends SIGTERM and waits up to `grace` for the exit; then SIGKILL. `Ok(None)`: it had to
    /// be killed.
    pub async fn terminate(&mut self, grace: Duration) -> anyhow::Result<Option<ExitStatus>> {
        if let Some(status) = self.exited()? {
            return Ok(Some(status));
        }
        let _ = kill(self.pid, Signal::SIGTERM);
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => Ok(Some(status?)),
            Err(_) => {
                self.kill().await?;
                Ok(None)
            }
        }
    }
}

/// Whether `status` is death by `signal`.
pub fn died_of(status: ExitStatus, signal: Signal) -> bool {
    status.signal() == Some(signal as i32)
}

/// `exit 0`, `SIGABRT`, …
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => Signal::try_from(sig)
            .map(|s| s.as_str().to_owned())
            .unwrap_or_else(|_| format!("signal {sig}")),
        _ => format!("{status}"),
    }
}

/// The last `lines` lines of a log file, for failure reports.
pub fn tail(log: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
