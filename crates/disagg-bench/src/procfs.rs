//! What the bench reads from `/proc`, and the proxy child process.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::BoxError;
use crate::report::CpuClock;

/// CPU time a process spent, all threads, in clock ticks: `utime` and `stime`, fields
/// 14 and 15 of `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CpuTicks {
    /// In user space.
    pub(crate) user: u64,
    /// In the kernel.
    pub(crate) system: u64,
}

impl CpuTicks {
    /// User plus system.
    pub(crate) fn total(self) -> u64 {
        self.user + self.system
    }

    /// The ticks spent since `earlier`.
    pub(crate) fn since(self, earlier: CpuTicks) -> CpuTicks {
        CpuTicks {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// [`CpuTicks`] of `pid`.
pub(crate) fn cpu_ticks(pid: u32) -> io::Result<CpuTicks> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_cpu_ticks(&stat)
        .ok_or_else(|| io::Error::other(format!("cannot parse /proc/{pid}/stat: {stat}")))
}

fn parse_cpu_ticks(stat: &str) -> Option<CpuTicks> {
    // The command name (field 2) is in parentheses and may hold spaces and ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    let user = fields.nth(11)?.parse().ok()?;
    let system = fields.next()?.parse().ok()?;
    Some(CpuTicks { user, system })
}

/// On-CPU time of each live thread of a process, in nanoseconds: the first field of
/// `/proc/<pid>/task/<tid>/schedstat`, the scheduler's own running sum.
///
/// `/proc/<pid>/stat` reports the same sum rounded to clock ticks (10 ms at the usual
/// 100 Hz), which is 2-3% of a 2-second phase's proxy CPU; this reading is exact to the
/// scheduler's last update of each thread. It sees live threads only: a thread that ends
/// takes its time with it, so [`ThreadClocks::since`] gives no figure when a thread of
/// the first reading is gone, and misses a thread born and ended between the two
/// readings altogether; [`CpuReading::since`] checks it against the ticks (which keep
/// a dead thread's time) for that.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ThreadClocks(Vec<(u32, u64)>);

impl ThreadClocks {
    /// Nanoseconds the process ran since `earlier`: the growth of every thread `earlier`
    /// saw plus all of the threads born since. `None` when a thread of `earlier` is gone.
    pub(crate) fn since(&self, earlier: &ThreadClocks) -> Option<u64> {
        let mut sum = 0u64;
        for &(tid, before) in &earlier.0 {
            let (_, now) = self.0.iter().find(|(t, _)| *t == tid)?;
            sum += now.saturating_sub(before);
        }
        for &(tid, now) in &self.0 {
            if !earlier.0.iter().any(|(t, _)| *t == tid) {
                sum += now;
            }
        }
        Some(sum)
    }
}

/// Linux's "no such process" (`errno` 3), which reading an exiting thread's files gives.
const ESRCH: i32 = 3;

/// [`ThreadClocks`] of `pid`; `None` when the kernel keeps no schedstat (built without
/// `CONFIG_SCHED_INFO`) or a thread's file cannot be parsed.
pub(crate) fn thread_clocks(pid: u32) -> io::Result<Option<ThreadClocks>> {
    let mut clocks = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let stat = match std::fs::read_to_string(entry.path().join("schedstat")) {
            Ok(stat) => stat,
            // The thread ended between the listing and the read: it is not live. Linux
            // says so with ENOENT once it is gone, or ESRCH while it is exiting.
            Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(ESRCH) => {
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Ok(None),
            Err(e) => return Err(e),
        };
        match parse_schedstat(&stat) {
            Some(ns) => clocks.push((tid, ns)),
            None => return Ok(None),
        }
    }
    Ok(Some(ThreadClocks(clocks)))
}

fn parse_schedstat(stat: &str) -> Option<u64> {
    stat.split_whitespace().next()?.parse().ok()
}

/// One reading of a process's CPU time: the whole process's clock ticks and its live
/// threads' nanoseconds.
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuReading {
    ticks: CpuTicks,
    clocks: Option<ThreadClocks>,
}

/// What a process spent between two [`CpuReading`]s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CpuUsed {
    /// CPU seconds, user and kernel.
    pub(crate) secs: f64,
    /// Which clock `secs` comes from.
    pub(crate) clock: CpuClock,
    /// The clock ticks (the only reading that splits user from kernel time).
    pub(crate) ticks: CpuTicks,
}

/// How far the ticks may be ahead of the threads' nanoseconds before the difference
/// is taken for a thread that ended unseen: `utime` and `stime` are each rounded down
/// to a tick, so their sum's growth is within 2 ticks of the true growth.
const TICKS_SLACK: f64 = 2.0;

/// [`CpuReading`] of `pid`: its ticks, then its threads' clocks.
pub(crate) fn cpu_reading(pid: u32) -> io::Result<CpuReading> {
    Ok(CpuReading {
        ticks: cpu_ticks(pid)?,
        clocks: thread_clocks(pid)?,
    })
}

impl CpuReading {
    /// The CPU spent since `earlier`, with `ticks_per_sec` clock ticks a second.
    ///
    /// The threads' nanoseconds when every thread of `earlier` is still there and the
    /// ticks, which count the whole process with its dead threads, are not more than
    /// [`TICKS_SLACK`] ticks ahead of them; the ticks otherwise, as [`CpuClock::Ticks`]:
    /// then a thread ended during the interval (or the kernel keeps no schedstat), and
    /// its time is only in the ticks. Time of a thread born and ended in between that
    /// stays under the slack goes uncounted: no more than the ticks' own error.
    pub(crate) fn since(&self, earlier: &CpuReading, ticks_per_sec: f64) -> CpuUsed {
        let ticks = self.ticks.since(earlier.ticks);
        let ticks_secs = ticks.total() as f64 / ticks_per_sec;
        let ns = match (&earlier.clocks, &self.clocks) {
            (Some(before), Some(after)) => after.since(before),
            _ => None,
        };
        match ns {
            Some(ns) if ticks_secs <= ns as f64 / 1e9 + TICKS_SLACK / ticks_per_sec => CpuUsed {
                secs: ns as f64 / 1e9,
                clock: CpuClock::Scheduler,
                ticks,
            },
            _ => CpuUsed {
                secs: ticks_secs,
                clock: CpuClock::Ticks,
                ticks,
            },
        }
    }
}

/// A process's resident memory, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Memory {
    /// `VmRSS`: resident now, in KiB.
    pub(crate) rss_kib: u64,
    /// `VmHWM`: the most ever resident, in KiB.
    pub(crate) hwm_kib: u64,
}

/// [`Memory`] of `pid`.
pub(crate) fn memory(pid: u32) -> io::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_memory(&status)
        .ok_or_else(|| io::Error::other(format!("no VmRSS/VmHWM in /proc/{pid}/status")))
}

fn parse_memory(status: &str) -> Option<Memory> {
    let field = |name: &str| {
        status.lines().find_map(|l| {
            l.strip_prefix(name)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<u64>()
                .ok()
        })
    };
    Some(Memory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// Clock ticks per second (`getconf CLK_TCK`), and whether it was read (`false`: the
/// usual 100 is assumed).
pub(crate) fn clock_ticks() -> (f64, bool) {
    let read = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|&t| t > 0.0);
    match read {
        Some(t) => (t, true),
        None => (100.0, false),
    }
}

/// The machine: logical CPUs, CPU model, total memory in KiB.
pub(crate) fn machine() -> (usize, String, u64) {
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0);
    (cpus, model, mem)
}

/// The proxy, running as `<this executable> proxy ...` in a child process.
///
/// The child is killed when this is dropped (error paths included), and ends by itself
/// when its stdin closes, which happens too if the bench dies: no orphan outlives a run.
#[derive(Debug)]
pub(crate) struct ProxyProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    // Kept open so that the child never writes into a closed pipe.
    _stdout: Lines<BufReader<ChildStdout>>,
    pid: u32,
    addr: SocketAddr,
}

impl ProxyProcess {
    /// Start the proxy in front of `prefill` and `decode` with `threads` worker threads
    /// and the `extra` flags, and wait until it listens.
    pub(crate) async fn spawn(
        prefill: &str,
        decode: &str,
        threads: usize,
        extra: &[&str],
    ) -> Result<ProxyProcess, BoxError> {
        Self::spawn_kind("proxy", prefill, decode, threads, extra).await
    }

    /// Start the floor proxy (`<this executable> floor ...`) the same way.
    pub(crate) async fn spawn_floor(
        prefill: &str,
        decode: &str,
        threads: usize,
    ) -> Result<ProxyProcess, BoxError> {
        Self::spawn_kind("floor", prefill, decode, threads, &[]).await
    }

    async fn spawn_kind(
        subcommand: &str,
        prefill: &str,
        decode: &str,
        threads: usize,
        extra: &[&str],
    ) -> Result<ProxyProcess, BoxError> {
        let exe = std::env::current_exe()?;
        let mut command = Command::new(exe);
        command.arg(subcommand);
        if subcommand == "proxy" {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        let mut child = command
            .args(["--prefill", prefill, "--decode", decode])
            .args(["--threads", &threads.to_string()])
            .args(extra)
            // Traces go to --otlp-endpoint only, which --proxy-args may give on
            // 127.0.0.1: never to a collector the environment names.
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the proxy process: {e}"))?;
        let pid = child.id().ok_or("the proxy process has no pid")?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or("the proxy process has no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = match tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => {
                let status = child.wait().await?;
                return Err(format!("the proxy process exited before listening ({status})").into());
            }
            Ok(Err(e)) => return Err(format!("cannot read the proxy's address: {e}").into()),
            Err(_) => return Err("the proxy did not report its address within 20 s".into()),
        };
        let addr: SocketAddr = line
            .trim()
            .parse()
            .map_err(|e| format!("the proxy printed {line:?}, not an address: {e}"))?;
        if addr.ip() != IpAddr::V4(Ipv4Addr::LOCALHOST) {
            return Err(format!("the proxy listens on {addr}, not on 127.0.0.1").into());
        }
        Ok(ProxyProcess {
            child,
            stdin,
            _stdout: lines,
            pid,
            addr,
        })
    }

    /// The child's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its [`Memory`]; that it exited, if it did.
    pub(crate) fn memory(&mut self) -> Result<Memory, BoxError> {
        self.read(memory)
    }

    /// Its [`CpuReading`]; that it exited, if it did.
    pub(crate) fn cpu(&mut self) -> Result<CpuReading, BoxError> {
        self.read(cpu_reading)
    }

    /// `read` of its pid, after checking that it still runs; when the read fails, that
    /// it exited meanwhile if it did (an exited child's `/proc` files lose their
    /// figures, or go), the read's own error otherwise.
    fn read<T>(&mut self, read: impl FnOnce(u32) -> io::Result<T>) -> Result<T, BoxError> {
        self.check_alive()?;
        match read(self.pid) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.check_alive()?;
                Err(e.into())
            }
        }
    }

    /// Fails if the child has exited.
    pub(crate) fn check_alive(&mut self) -> Result<(), BoxError> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => Err(format!("the proxy process exited ({status})").into()),
        }
    }

    /// Close its stdin so that it shuts down, and wait for it (killing it after 5 s).
    pub(crate) async fn stop(mut self) -> Result<(), BoxError> {
        drop(self.stdin.take());
        match tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(format!("the proxy process ended with {status}").into()),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => {
                self.child.kill().await?;
                Err("the proxy process did not stop within 5 s; killed".into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat() {
        let stat = "1234 (tokio (rt) x) S 1 1234 1234 0 -1 4194560 100 0 0 0 \
                    250 75 0 0 20 0 3 0 123 456 789";
        let ticks = parse_cpu_ticks(stat);
        assert_eq!(
            ticks,
            Some(CpuTicks {
                user: 250,
                system: 75
            })
        );
        assert_eq!(ticks.map(CpuTicks::total), Some(325));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn thread_clocks_add_growth_and_new_threads_and_refuse_a_lost_thread() {
        assert_eq!(parse_schedstat("96690384 19919402 352\n"), Some(96_690_384));
        assert_eq!(parse_schedstat(""), None);
        let before = ThreadClocks(vec![(1, 1_000), (2, 5_000)]);
        // Thread 1 ran 500 ns more, thread 2 none, thread 3 was born and ran 250 ns.
        let after = ThreadClocks(vec![(1, 1_500), (2, 5_000), (3, 250)]);
        assert_eq!(after.since(&before), Some(750));
        // Thread 2 ended: its time is no longer readable per thread.
        let lost = ThreadClocks(vec![(1, 1_500), (3, 250)]);
        assert_eq!(lost.since(&before), None);
    }

    #[test]
    fn threads_ending_during_the_read_are_skipped() {
        // Threads born and ended while the clocks are read, over and over: a thread may
        // be listed and gone (or exiting) by the time its schedstat is read.
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = Arc::new(AtomicBool::new(false));
        let churn = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _ = std::thread::spawn(|| {}).join();
                }
            })
        };
        let pid = std::process::id();
        let mut failed = None;
        for _ in 0..3_000 {
            if let Err(e) = thread_clocks(pid) {
                failed = Some(e);
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let _ = churn.join();
        assert!(failed.is_none(), "{failed:?}");
    }

    #[test]
    fn ticks_ahead_of_the_clocks_by_more_than_their_rounding_are_taken() {
        let reading = |ticks: u64, ns: u64| CpuReading {
            ticks: CpuTicks {
                user: ticks,
                system: 0,
            },
            clocks: Some(ThreadClocks(vec![(1, ns)])),
        };
        let before = reading(100, 0);
        // 30 ms by both: the nanoseconds.
        let used = reading(103, 30_000_000).since(&before, 100.0);
        assert_eq!((used.clock, used.secs), (CpuClock::Scheduler, 0.03));
        // The ticks round down each of utime and stime: 2 ticks ahead is still rounding.
        let used = reading(105, 30_000_000).since(&before, 100.0);
        assert_eq!(used.clock, CpuClock::Scheduler);
        // 3 ticks ahead: a thread ran and ended unseen, and the ticks have its time.
        let used = reading(106, 30_000_000).since(&before, 100.0);
        assert_eq!((used.clock, used.secs), (CpuClock::Ticks, 0.06));
        // No schedstat: the ticks.
        let used = CpuReading {
            clocks: None,
            ..reading(103, 0)
        }
        .since(&before, 100.0);
        assert_eq!(used.clock, CpuClock::Ticks);
    }

    #[test]
    fn own_threads_clock_grows_with_work() -> io::Result<()> {
        let pid = std::process::id();
        // This thread alone: the harness's other test threads come and go meanwhile.
        let me: u32 = std::fs::read_link("/proc/thread-self")?
            .file_name()
            .and_then(|t| t.to_str()?.parse().ok())
            .ok_or_else(|| io::Error::other("no thread id in /proc/thread-self"))?;
        let mine = |clocks: ThreadClocks| {
            ThreadClocks(clocks.0.into_iter().filter(|(t, _)| *t == me).collect())
        };
        let Some(before) = thread_clocks(pid)?.map(mine) else {
            return Ok(()); // no schedstat in this kernel: nothing to read
        };
        assert_eq!(before.0.len(), 1, "this thread is listed");
        // 30 ms of this thread's own CPU time, however long the machine takes to give
        // it (a wall-clock spin may get a few ms of CPU on a loaded machine).
        let (ticks_per_sec, _) = clock_ticks();
        let start = this_thread_cpu_ns(ticks_per_sec)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut x = 0u64;
        loop {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            if this_thread_cpu_ns(ticks_per_sec)?.saturating_sub(start) >= 30_000_000 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "this thread's CPU clock did not reach 30 ms in 30 s"
            );
        }
        // The reading of all threads finds this one's 30 ms (allow a few ticks, should
        // the thread's own reading above have been its ticks).
        let after = thread_clocks(pid)?.map(mine).unwrap_or_default();
        let ran = after.since(&before);
        assert!(ran.is_some_and(|ns| ns >= 10_000_000), "{ran:?}");
        Ok(())
    }

    #[test]
    fn parses_status() {
        let status = "Name:\tdisagg-bench\nVmHWM:\t   15360 kB\nVmRSS:\t    9876 kB\n";
        let m = parse_memory(status);
        assert_eq!(m.map(|m| (m.rss_kib, m.hwm_kib)), Some((9876, 15360)));
    }

    #[test]
    fn reads_own_process() -> io::Result<()> {
        let pid = std::process::id();
        cpu_ticks(pid)?;
        assert!(memory(pid)?.rss_kib > 0);
        Ok(())
    }

    /// This thread's own CPU time, in ns: its schedstat, or its clock ticks.
    fn this_thread_cpu_ns(ticks_per_sec: f64) -> io::Result<u64> {
        if let Ok(stat) = std::fs::read_to_string("/proc/thread-self/schedstat")
            && let Some(ns) = parse_schedstat(&stat)
        {
            return Ok(ns);
        }
        let stat = std::fs::read_to_string("/proc/thread-self/stat")?;
        let ticks = parse_cpu_ticks(&stat).ok_or_else(|| io::Error::other(stat.clone()))?;
        Ok((ticks.total() as f64 / ticks_per_sec * 1e9) as u64)
    }

    #[test]
    fn a_thread_born_and_ended_between_two_readings_is_counted() -> io::Result<()> {
        let (ticks_per_sec, _) = clock_ticks();
        let pid = std::process::id();
        let before = cpu_reading(pid)?;
        // A thread that lives only between the two readings, and runs 50 ms of CPU.
        let spun = std::thread::spawn(move || -> io::Result<u64> {
            let start = this_thread_cpu_ns(ticks_per_sec)?;
            let mut x = 0u64;
            loop {
                for _ in 0..10_000 {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                let ran = this_thread_cpu_ns(ticks_per_sec)?.saturating_sub(start);
                if ran >= 50_000_000 {
                    return Ok(ran);
                }
            }
        })
        .join()
        .map_err(|_| io::Error::other("the spinning thread panicked"))??;
        let after = cpu_reading(pid)?;
        let used = after.since(&before, ticks_per_sec);
        // Nanoseconds count it whole; the ticks' fallback to within their own 2 ticks.
        let floor = match used.clock {
            CpuClock::Scheduler => spun as f64 / 1e9,
            CpuClock::Ticks => spun as f64 / 1e9 - 2.0 / ticks_per_sec,
        };
        assert!(used.secs >= floor, "{used:?}, the thread ran {spun} ns");
        Ok(())
    }

    /// A proxy process that has exited but is not reaped yet (a zombie: its
    /// `/proc/<pid>/status` has no memory lines).
    async fn exited_proxy() -> Result<ProxyProcess, BoxError> {
        let mut child = Command::new("true")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().ok_or("no pid")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        // Wait for the zombie state (field 3 of its stat) without reaping it.
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            if state == Some("Z") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(ProxyProcess {
            child,
            stdin,
            _stdout: BufReader::new(stdout).lines(),
            pid,
            addr: SocketAddr::from(([127, 0, 0, 1], 9)),
        })
    }

    #[tokio::test]
    async fn reading_a_dead_proxy_says_it_exited() -> Result<(), BoxError> {
        let mut proxy = exited_proxy().await?;
        let err = proxy.memory().err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("exited")),
            "{err:?}"
        );
        let mut proxy = exited_proxy().await?;
        let err = proxy.cpu().err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("exited")),
            "{err:?}"
        );
        Ok(())
    }
}
