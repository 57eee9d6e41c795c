//! `--workers N --reducer threads|sequential|mpi`: the MLP trained data-parallel, its
//! speedup against one worker measured alongside, and its JSON.

use std::time::Instant;

use ndarray::{Ix1, Ix2};

use crate::args::Args;
use crate::breakdown;
use crate::data::Dataset;
use crate::parallel::{self, Setup};
use crate::train::{build_network, mode_name, prefetcher};
use crate::{Res, CLASSES, FEATURES};

pub(crate) fn run(args: &Args, train: &Dataset, test: &Dataset) -> Res<()> {
    let mut setup = Setup::new(args.workers, args.reducer)?;
    let root = setup.is_root();
    let say = |text: String| match (root, args.json) {
        (false, _) => {}
        (true, true) => eprintln!("{text}"),
        (true, false) => println!("{text}"),
    };
    let mode = args.workspace_mode;
    let batch = args.batch_size.min(train.y.len());
    let per_epoch = train.y.len().div_ceil(batch);
    let hidden: Vec<String> = args.hidden.iter().map(usize::to_string).collect();
    say(format!(
        "train_digits: MLP {FEATURES}-{}-{CLASSES}, Adam lr {}, batch {batch}, seed {}; {} workers ({}), {} rows \
         per worker",
        hidden.join("-"),
        args.lr,
        args.seed,
        setup.workers,
        setup.reducer.name(),
        batch.div_ceil(setup.workers),
    ));
    let mut trainers = setup.trainers(|| build_network(args, mode))?;
    trainers.reserve(per_epoch.saturating_mul(args.epochs));
    let mut batches = prefetcher(train, batch, args.seed, args.prefetch_depth, mode)?;
    // The one-worker trainer's batches: the same, in the same order.
    let mut baseline = match trainers.has_baseline() {
        true => Some(prefetcher(train, batch, args.seed, args.prefetch_depth, mode)?),
        false => None,
    };
    for epoch in 1..=args.epochs {
        if args.breakdown && epoch == 2 {
            // The steady steps' breakdown: the workers' passes and the reduction, the
            // update, each worker's shard (the N workers' trainer only).
            trainers.main.set_breakdown(true);
        }
        let start = Instant::now();
        let mut loss_sum = 0.0f64;
        let mut b = 0;
        while let Some(lease) = batches.next() {
            let context = |e: &dyn std::fmt::Display| format!("epoch {epoch}, batch {}: {e}", b + 1);
            let lease = lease.map_err(|e| context(&e))?;
            // The batch, in place in the prefetch ring: every worker's shard is a view of it.
            let x = lease.features::<f32, Ix2>().map_err(|e| context(&e))?;
            let y = lease.labels::<u32, Ix1>().map_err(|e| context(&e))?;
            let loss = trainers.fit(x.into(), y.into()).map_err(|e| context(&e))?;
            loss_sum += f64::from(loss);
            b += 1;
        }
        batches.reset()?;
        if let Some(baseline) = baseline.as_mut() {
            while let Some(lease) = baseline.next() {
                let lease = lease?;
                trainers.fit_one(lease.features::<f32, Ix2>()?.into(), lease.labels::<u32, Ix1>()?.into())?;
            }
            baseline.reset()?;
        }
        if !args.json && (epoch == 1 || epoch == args.epochs || epoch.is_multiple_of(10)) {
            say(format!(
                "epoch {epoch:>4}/{}: loss {:.4}  {:.1} ms",
                args.epochs,
                loss_sum / b.max(1) as f64,
                start.elapsed().as_secs_f64() * 1e3
            ));
        }
    }
    let summary = trainers.summary(&setup, per_epoch);
    let mut fields = trainers.json(&setup, per_epoch);
    if let Some(b) = trainers.main.breakdown() {
        say(breakdown::breakdown_lines(&format!("{} workers", setup.workers), &b));
        fields["breakdown_us"] = breakdown::breakdown_json(&b);
    }
    let mut network = trainers.main.into_network()?;
    let test_accuracy = network.evaluate(test.x.view(), test.y.view(), batch)?;
    let train_accuracy = network.evaluate(train.x.view(), train.y.view(), batch)?;
    say(summary);
    say(format!("test accuracy {test_accuracy:.4}, train accuracy {train_accuracy:.4}"));
    say(format!("loss trace sha256 {}", fields["loss_trace_sha256"].as_str().unwrap_or("")));
    if let Some(path) = &args.save {
        if root {
            network.save(path).map_err(|e| format!("saving the model: {e}"))?;
            say(format!("model saved to {}", path.display()));
        }
    }
    if args.json && root {
        fields["test_accuracy"] = test_accuracy.into();
        fields["train_accuracy"] = train_accuracy.into();
        fields["final_loss"] = trainers.loss.last().map(|&l| f64::from(l)).into();
        let lr: f64 = args.lr.to_string().parse()?;
        let object = serde_json::json!({
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "batch_size_used": batch,
            "hidden": args.hidden,
            "threads": args.threads,
            "seed": args.seed,
            "lr": lr,
            "train_rows": train.y.len(),
            "test_rows": test.y.len(),
            "saved": args.save.as_ref().map(|p| p.display().to_string()),
        });
        parallel::print_json(object, fields, mode_name(mode))?;
    }
    Ok(())
}
