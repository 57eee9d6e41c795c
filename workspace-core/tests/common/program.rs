//! Random programs run on real workspaces, checked as they run: opens, nested opens,
//! frames (closed in any order, or forgotten), allocations from a scope or from any
//! open frame, and closes, over a few workspaces. Every allocation is checked against
//! the live ones (an interval checker over the addresses handed out) and gets a
//! pattern written into it, checked when it dies: at its frame's close, or at the end
//! of its cycle (an allocation of a forgotten frame lives to the end of its cycle).

#![allow(dead_code)] // each test binary uses part of it

use std::rc::Rc;

use allocator_api2::alloc::{Allocator, Layout};
use workspace_core::planned::PlanGroup;
use workspace_core::{Frame, Scope, Workspace};

use super::random::Rng;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Op {
    /// Enter the member (opens a cycle, or nests in the open one).
    Open(usize),
    /// Allocate `bytes` aligned to `align` from the member's innermost scope (`at` 0)
    /// or from its open frame number `at - 1` (modulo their number; the scope when it
    /// has none).
    Alloc { member: usize, bytes: usize, align: usize, at: usize },
    /// Close the member's innermost scope (the last one ends its cycle), after the
    /// frames opened in it.
    Close(usize),
    /// Open a frame in the member's innermost scope.
    Frame(usize),
    /// Close the member's open frame number `k` (modulo their number; 0 the newest).
    EndFrame(usize, usize),
    /// Forget (`mem::forget`) the member's newest open frame.
    Forget(usize),
    /// Finish the group's iteration (scopes and frames stay open; until `Start`,
    /// members allocate as unplanned workspaces).
    Finish,
    /// Start the group's iteration here, with scopes and frames open (a program with a
    /// `Start` runs unplanned before it).
    Start,
}

impl Op {
    fn member(self) -> usize {
        match self {
            Op::Open(m) | Op::Close(m) | Op::Frame(m) | Op::EndFrame(m, _) | Op::Forget(m) => m,
            Op::Alloc { member, .. } => member,
            Op::Finish | Op::Start => 0,
        }
    }
}

/// A program over `members` workspaces; `frames` adds frame operations.
pub(crate) fn program(rng: &mut Rng, members: usize, frames: bool) -> Vec<Op> {
    let len = 4 + rng.below(40) as usize;
    (0..len)
        .map(|_| {
            let member = rng.below(members as u64) as usize;
            let kinds = if frames { 13 } else { 8 };
            match rng.below(kinds) {
                0 | 1 => Op::Open(member),
                2 | 3 => Op::Close(member),
                8 | 9 => Op::Frame(member),
                10 | 11 => Op::EndFrame(member, if rng.below(3) == 0 { rng.below(4) as usize } else { 0 }),
                12 => Op::Forget(member),
                _ => {
                    let limit = if rng.below(8) == 0 { 20_000 } else { 700 };
                    let bytes = 1 + rng.below(limit) as usize;
                    let align = [1, 4, 16, 64, 64, 256, 4096][rng.below(7) as usize];
                    let at = if frames { rng.below(4) as usize } else { 0 };
                    Op::Alloc { member, bytes, align, at }
                }
            }
        })
        .collect()
}

/// Variants of `ops` that diverge from it at position `k`: an allocation larger than
/// recorded, an operation left out, an allocation added, the iteration started only
/// there (what ran before, unplanned, stays open into the replay), the iteration
/// finished there (the rest runs unplanned), two operations swapped.
pub(crate) fn variants(ops: &[Op], k: usize, members: usize) -> Vec<Vec<Op>> {
    let mut out = Vec::new();
    if let Op::Alloc { member, bytes, align, at } = ops[k] {
        let mut larger = ops.to_vec();
        larger[k] = Op::Alloc { member, bytes: bytes + 64 * (1 + k % 7), align, at };
        out.push(larger);
    }
    let mut fewer = ops.to_vec();
    fewer.remove(k);
    out.push(fewer);
    let mut more = ops.to_vec();
    more.insert(k, Op::Alloc { member: (ops[k].member() + 1) % members, bytes: 100 + k, align: 64, at: k % 3 });
    out.push(more);
    let mut late = ops.to_vec();
    late.insert(k, Op::Start);
    out.push(late);
    let mut early = ops.to_vec();
    early.insert(k, Op::Finish);
    out.push(early);
    if k + 1 < ops.len() {
        let mut swapped = ops.to_vec();
        swapped.swap(k, k + 1);
        out.push(swapped);
    }
    out
}

/// Who an allocation dies with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Owner {
    /// The end of the member's cycle.
    Cycle,
    /// The close of the frame with this id.
    Frame(u64),
}

/// A live allocation: address, length, member, owner, and the pattern byte written
/// into it.
#[derive(Clone, Copy, Debug)]
struct Live {
    addr: usize,
    len: usize,
    member: usize,
    owner: Owner,
    tag: u8,
}

/// An open frame, with the index of the scope it was opened in and its id.
struct Open {
    frame: Frame<'static>,
    scope: usize,
    id: u64,
}

/// Checks the pattern of every live allocation of `member` that `dies` picks, and
/// forgets them.
fn end(live: &mut Vec<Live>, member: usize, dies: impl Fn(&Live) -> bool) {
    live.retain(|l| {
        if l.member != member || !dies(l) {
            return true;
        }
        // SAFETY: the allocation's scope or frame is still open (it closes right after
        // this check), so its memory is valid and ours.
        let bytes = unsafe { std::slice::from_raw_parts(l.addr as *const u8, l.len) };
        assert!(bytes.iter().all(|&b| b == l.tag), "an allocation of member {member} was overwritten: {l:?}");
        false
    });
}

/// Runs `ops` (as one iteration of `group`, if any) on `members`; returns the number of
/// allocations made.
pub(crate) fn run(group: Option<&PlanGroup>, members: &[Rc<Workspace>], ops: &[Op], key: u64, seed: u64) -> usize {
    if let Some(group) = group.filter(|_| !ops.contains(&Op::Start)) {
        group.start_iteration(key).unwrap();
    }
    let mut scopes: Vec<Vec<Box<Scope<'static>>>> = members.iter().map(|_| Vec::new()).collect();
    let mut frames: Vec<Vec<Open>> = members.iter().map(|_| Vec::new()).collect();
    let mut live: Vec<Live> = Vec::new();
    let (mut made, mut next_frame) = (0, 0u64);
    let mut tag = seed as u8;
    for &op in ops {
        match op {
            Op::Open(m) => scopes[m].push(Box::new(members[m].enter_shared().unwrap())),
            Op::Close(m) => {
                let Some(index) = scopes[m].len().checked_sub(1) else { continue };
                // The frames of the scope close first (they borrow it).
                while let Some(at) = frames[m].iter().rposition(|f| f.scope == index) {
                    let open = frames[m].remove(at);
                    end(&mut live, m, |l| l.owner == Owner::Frame(open.id));
                }
                if index == 0 {
                    end(&mut live, m, |_| true);
                }
                scopes[m].pop();
            }
            Op::Frame(m) => {
                let Some(scope) = scopes[m].last() else { continue };
                // SAFETY: the box stays in `scopes[m]` until every frame made from it
                // has been dropped (`Close` and the end of the run drop them first).
                let scope: &'static Scope<'static> = unsafe { &*(&**scope as *const Scope<'static>) };
                next_frame += 1;
                let index = scopes[m].len() - 1;
                frames[m].push(Open { frame: scope.frame().unwrap(), scope: index, id: next_frame });
            }
            Op::EndFrame(m, k) => {
                let count = frames[m].len();
                if count == 0 {
                    continue;
                }
                let open = frames[m].remove(count - 1 - k % count);
                end(&mut live, m, |l| l.owner == Owner::Frame(open.id));
                drop(open);
            }
            Op::Finish => {
                if let Some(group) = group {
                    group.finish_iteration().unwrap();
                }
            }
            Op::Start => {
                if let Some(group) = group {
                    group.start_iteration(key).unwrap();
                }
            }
            Op::Forget(m) => {
                let Some(open) = frames[m].pop() else { continue };
                // Its allocations live on to the end of the cycle.
                for l in live.iter_mut().filter(|l| l.owner == Owner::Frame(open.id)) {
                    l.owner = Owner::Cycle;
                }
                std::mem::forget(open.frame);
            }
            Op::Alloc { member: m, bytes, align, at } => {
                let Some(scope) = scopes[m].last() else { continue };
                let count = frames[m].len();
                let (ptr, owner) = if at == 0 || count == 0 {
                    (typed_or_raw(&**scope, bytes, align), Owner::Cycle)
                } else {
                    let open = &frames[m][(at - 1) % count];
                    (typed_or_raw(&open.frame, bytes, align), Owner::Frame(open.id))
                };
                let (addr, len) = (ptr, bytes);
                assert_eq!(addr % align, 0, "misaligned allocation of {bytes} B aligned to {align}");
                for other in &live {
                    assert!(
                        addr + len <= other.addr || other.addr + other.len <= addr,
                        "allocation [{addr:#x}, +{len}) of member {m} overlaps a live one: {other:?}"
                    );
                }
                tag = tag.wrapping_add(1).max(1);
                // SAFETY: `addr..addr + len` was just handed out by the open scope or frame.
                unsafe { std::ptr::write_bytes(addr as *mut u8, tag, len) };
                live.push(Live { addr, len, member: m, owner, tag });
                made += 1;
            }
        }
    }
    for m in 0..members.len() {
        while let Some(open) = frames[m].pop() {
            end(&mut live, m, |l| l.owner == Owner::Frame(open.id));
        }
        if !scopes[m].is_empty() {
            end(&mut live, m, |_| true);
        }
        while scopes[m].pop().is_some() {}
    }
    if let Some(group) = group {
        group.finish_iteration().unwrap();
    }
    made
}

/// Something that hands out memory (a scope or a frame), typed for small alignments and
/// through the allocator interface for larger ones.
trait Carve {
    fn typed(&self, bytes: usize, align: usize) -> usize;
    fn raw(&self, layout: Layout) -> usize;
}

macro_rules! carve {
    ($ty:ty) => {
        impl Carve for $ty {
            fn typed(&self, bytes: usize, align: usize) -> usize {
                match align {
                    1 => self.uninit::<u8, _>(bytes).unwrap().as_mut_ptr() as usize,
                    4 => self.slice_uninit::<u32>(bytes.div_ceil(4)).unwrap().as_mut_ptr() as usize,
                    _ => self.uninit::<u128, _>(bytes.div_ceil(16)).unwrap().as_mut_ptr() as usize,
                }
            }
            fn raw(&self, layout: Layout) -> usize {
                (&self).allocate(layout).unwrap().as_ptr() as *mut u8 as usize
            }
        }
    };
}
carve!(Scope<'_>);
carve!(Frame<'_>);

fn typed_or_raw(target: &impl Carve, bytes: usize, align: usize) -> usize {
    if align <= 16 {
        target.typed(bytes, align)
    } else {
        target.raw(Layout::from_size_align(bytes, align).unwrap())
    }
}
