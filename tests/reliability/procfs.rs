//! Readings of a live process from `/proc` (Linux).

/// Resident set size in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vmrss(&status)
}

fn parse_vmrss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Open file descriptors (entries of `/proc/<pid>/fd`).
pub fn fd_count(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// User + system CPU time in clock ticks (fields 14 and 15 of `/proc/<pid>/stat`).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields resume after its `)`.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 when it cannot be read).
pub fn ticks_per_sec() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        assert_eq!(parse_vmrss("Name:\tx\nVmRSS:\t  1234 kB\n"), Some(1234));
        assert_eq!(parse_vmrss("Name:\tx\n"), None);
        let me = std::process::id();
        assert!(rss_kib(me).unwrap() > 0);
        assert!(fd_count(me).unwrap() >= 3);
        assert!(cpu_ticks(me).is_some());
    }
}
