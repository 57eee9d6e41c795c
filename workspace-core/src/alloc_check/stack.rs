//! Where an allocation was made: walking the calling stack inside the allocator (glibc's
//! `backtrace`, which neither allocates nor locks once loaded), and naming each return
//! address by its object file and offset from `/proc/self/maps` afterwards, outside it.
//! The counting allocator (`super`) calls these; see its module docs for what a trace
//! costs and why symbolising waits until the report is printed.

use super::TRACE_FRAMES;

/// Fills `addrs` with the return addresses of the calling stack, innermost first, and
/// returns how many. Never allocates or locks once [`load_walker`] has run.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn walk(addrs: &mut [usize; TRACE_FRAMES]) -> usize {
    let mut frames = [std::ptr::null_mut::<libc::c_void>(); TRACE_FRAMES];
    // SAFETY: `backtrace` writes at most `TRACE_FRAMES` pointers into `frames`, which
    // holds that many, and returns how many it wrote.
    let written = unsafe { libc::backtrace(frames.as_mut_ptr(), TRACE_FRAMES as libc::c_int) };
    let len = usize::try_from(written).unwrap_or(0).min(TRACE_FRAMES);
    for (addr, frame) in addrs.iter_mut().zip(&frames[..len]) {
        *addr = *frame as usize;
    }
    len
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn walk(_addrs: &mut [usize; TRACE_FRAMES]) -> usize {
    0
}

/// Loads what [`walk`] needs, outside the allocator: glibc's first `backtrace`
/// loads the unwinder (`dlopen`, which allocates and takes the loader's lock).
pub(super) fn load_walker() {
    static LOADED: std::sync::Once = std::sync::Once::new();
    LOADED.call_once(|| {
        let mut addrs = [0_usize; TRACE_FRAMES];
        walk(&mut addrs);
    });
}

/// Each return address as `object file +0xoffset` (the offset of the call instruction
/// from the object's load address, which `addr2line` takes for position-independent
/// executables and shared objects), or as the bare address where the object is unknown.
/// Reads the process's mappings from `/proc/self/maps` when asked (no unsafe code: an
/// object unloaded since the walk gives a wrong name, never a dangling read).
#[cfg(target_os = "linux")]
pub(super) fn resolve(addrs: &[usize]) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let regions: Vec<Region<'_>> = maps.lines().filter_map(Region::parse).collect();
    addrs
        .iter()
        .map(|&ret| {
            let addr = ret.saturating_sub(1); // the call, not the instruction after it
            let Some(region) = regions.iter().find(|r| r.start <= addr && addr < r.end && r.path.starts_with('/'))
            else {
                return format!("{addr:#x}");
            };
            // The load address: where the object's first page (offset 0) is mapped.
            let base = regions
                .iter()
                .filter(|r| r.path == region.path && r.offset == 0)
                .map(|r| r.start)
                .min()
                .unwrap_or(region.start.wrapping_sub(region.offset));
            format!("{} +{:#x}", region.path, addr.wrapping_sub(base))
        })
        .collect()
}

#[cfg(not(target_os = "linux"))]
pub(super) fn resolve(addrs: &[usize]) -> Vec<String> {
    addrs.iter().map(|&ret| format!("{:#x}", ret.saturating_sub(1))).collect()
}

/// One line of `/proc/self/maps`: `start-end perms offset dev inode   path`.
#[cfg(target_os = "linux")]
struct Region<'m> {
    start: usize,
    end: usize,
    offset: usize,
    path: &'m str,
}

#[cfg(target_os = "linux")]
impl<'m> Region<'m> {
    fn parse(line: &'m str) -> Option<Self> {
        // The first five fields are separated by one space; the path is padded.
        let mut fields = line.splitn(6, ' ');
        let (start, end) = fields.next()?.split_once('-')?;
        let _perms = fields.next()?;
        let offset = fields.next()?;
        let path = fields.nth(2).unwrap_or("").trim_start();
        Some(Region {
            start: usize::from_str_radix(start, 16).ok()?,
            end: usize::from_str_radix(end, 16).ok()?,
            offset: usize::from_str_radix(offset, 16).ok()?,
            path,
        })
    }
}
