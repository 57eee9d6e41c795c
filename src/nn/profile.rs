//! Where a training step's time goes: [`StepBreakdown`], from
//! [`Network::set_breakdown`](crate::nn::Network::set_breakdown).
//!
//! The step's code marks its parts with spans (a guard each); a thread-local clock
//! charges every nanosecond of the step to exactly one part: the innermost open span's,
//! or [`Part::Bookkeeping`] outside every span (workspace scopes, the shape checks, the
//! glue between layers). Off, a span is one thread-local read.

use std::cell::Cell;
use std::time::Instant;

/// A part of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// Matrix multiplication ([`sgemm`](crate::nn::gemm::sgemm)).
    MatMul = 0,
    /// Elementwise work of the layers: biases, activations and their gradients, the
    /// LSTM's gates and cell.
    Elementwise,
    /// Softmax, cross-entropy and their gradient.
    Loss,
    /// The updater's step (its staged values checked as they are computed).
    Updater,
    /// The finite checks of inputs, outputs, gradients and parameters.
    Checks,
    /// Copies and fills: a batch copied into the activations, gradients zeroed.
    Copies,
    /// Everything else: workspace scopes and allocations, shape checks, glue.
    Bookkeeping,
}

const PARTS: usize = 7;

/// The time of the training steps since breakdown was switched on (or last reset), per
/// part, in nanoseconds: every nanosecond of a step is in exactly one part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepBreakdown {
    /// Steps measured.
    pub steps: u64,
    /// Matrix multiplication.
    pub matmul_ns: u64,
    /// Elementwise work of the layers (biases, activations, gates, and their gradients).
    pub elementwise_ns: u64,
    /// Softmax, cross-entropy and its gradient.
    pub loss_ns: u64,
    /// The updater's step.
    pub updater_ns: u64,
    /// Finite checks.
    pub checks_ns: u64,
    /// Copies and fills (the batch into the activations, gradients zeroed).
    pub copies_ns: u64,
    /// Workspace bookkeeping, shape checks and glue: what no other part holds.
    pub bookkeeping_ns: u64,
}

impl StepBreakdown {
    /// Every part's name and its mean µs per step, in a fixed order.
    pub fn per_step_us(&self) -> [(&'static str, f64); PARTS] {
        let us = |ns: u64| if self.steps == 0 { 0.0 } else { ns as f64 / 1e3 / self.steps as f64 };
        [
            ("matmul", us(self.matmul_ns)),
            ("elementwise", us(self.elementwise_ns)),
            ("loss", us(self.loss_ns)),
            ("updater", us(self.updater_ns)),
            ("checks", us(self.checks_ns)),
            ("copies", us(self.copies_ns)),
            ("bookkeeping", us(self.bookkeeping_ns)),
        ]
    }

    /// The nanoseconds of every part together.
    pub fn total_ns(&self) -> u64 {
        self.matmul_ns
            + self.elementwise_ns
            + self.loss_ns
            + self.updater_ns
            + self.checks_ns
            + self.copies_ns
            + self.bookkeeping_ns
    }

    fn add(&mut self, ns: &[u64; PARTS]) {
        self.steps += 1;
        self.matmul_ns += ns[Part::MatMul as usize];
        self.elementwise_ns += ns[Part::Elementwise as usize];
        self.loss_ns += ns[Part::Loss as usize];
        self.updater_ns += ns[Part::Updater as usize];
        self.checks_ns += ns[Part::Checks as usize];
        self.copies_ns += ns[Part::Copies as usize];
        self.bookkeeping_ns += ns[Part::Bookkeeping as usize];
    }
}

/// The clock of the step running on this thread, when one is measured.
struct Clock {
    on: Cell<bool>,
    part: Cell<Part>,
    mark: Cell<Option<Instant>>,
    ns: [Cell<u64>; PARTS],
}

thread_local! {
    static CLOCK: Clock = const {
        Clock {
            on: Cell::new(false),
            part: Cell::new(Part::Bookkeeping),
            mark: Cell::new(None),
            ns: [const { Cell::new(0) }; PARTS],
        }
    };
}

impl Clock {
    /// Charges the time since the last mark to the current part; returns now.
    fn charge(&self) -> Instant {
        let now = Instant::now();
        if let Some(mark) = self.mark.get() {
            let part = self.part.get() as usize;
            self.ns[part].set(self.ns[part].get() + now.saturating_duration_since(mark).as_nanos() as u64);
        }
        self.mark.set(Some(now));
        now
    }
}

/// A part of the step, charged until this drops (then the enclosing part resumes).
pub(crate) struct Span(Option<Part>);

/// Opens a span of `part` (nothing when no step is measured on this thread).
pub(crate) fn span(part: Part) -> Span {
    CLOCK.with(|clock| {
        if !clock.on.get() {
            return Span(None);
        }
        clock.charge();
        Span(Some(clock.part.replace(part)))
    })
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(previous) = self.0 {
            CLOCK.with(|clock| {
                clock.charge();
                clock.part.set(previous);
            });
        }
    }
}

/// A step measured on this thread: [`Step::finish`] adds its parts to a breakdown.
pub(crate) struct Step(bool);

/// Starts measuring a step on this thread when `on` (a step already measured, an outer
/// network's, goes on being measured and this one is not).
pub(crate) fn start(on: bool) -> Step {
    CLOCK.with(|clock| {
        if !on || clock.on.get() {
            return Step(false);
        }
        clock.on.set(true);
        clock.part.set(Part::Bookkeeping);
        for ns in &clock.ns {
            ns.set(0);
        }
        clock.mark.set(Some(Instant::now()));
        Step(true)
    })
}

impl Step {
    /// Stops measuring; adds the step's parts to `into` (a step that failed is not
    /// added: drop it instead).
    pub(crate) fn finish(mut self, into: &mut StepBreakdown) {
        if self.0 {
            let ns = CLOCK.with(|clock| {
                clock.charge();
                std::array::from_fn(|i| clock.ns[i].get())
            });
            into.add(&ns);
            self.stop();
        }
    }

    fn stop(&mut self) {
        if std::mem::take(&mut self.0) {
            CLOCK.with(|clock| {
                clock.on.set(false);
                clock.mark.set(None);
            });
        }
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nanosecond_is_charged_to_one_part_and_spans_nest() {
        let mut breakdown = StepBreakdown::default();
        let wall = std::time::Instant::now();
        let step = start(true);
        {
            let _m = span(Part::MatMul);
            std::thread::sleep(std::time::Duration::from_millis(3));
            {
                let _c = span(Part::Checks);
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        step.finish(&mut breakdown);
        let wall = wall.elapsed().as_nanos() as u64;
        assert_eq!(breakdown.steps, 1);
        // The outer span is charged its own time only, the inner span's to the inner
        // part: no nanosecond twice (sleeps may run long on a loaded machine, so only
        // lower bounds and the sum are checked).
        assert!(breakdown.matmul_ns >= 4_000_000, "{breakdown:?}");
        assert!(breakdown.checks_ns >= 2_000_000, "{breakdown:?}");
        assert!(breakdown.matmul_ns + breakdown.checks_ns <= wall, "{breakdown:?} in {wall} ns");
        assert_eq!(
            breakdown.total_ns(),
            breakdown.per_step_us().iter().map(|(_, us)| (us * 1e3).round() as u64).sum::<u64>()
        );
        // Off: spans charge nothing.
        let _s = span(Part::Loss);
        let mut other = StepBreakdown::default();
        start(false).finish(&mut other);
        assert_eq!(other, StepBreakdown::default());
    }
}
