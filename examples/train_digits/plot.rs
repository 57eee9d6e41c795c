//! The plot of `--plot`: per iteration of each mode, the workspace bytes in use, the
//! heap bytes in use (on the same scale: with workspaces off the memory is on the heap)
//! and the heap allocations. Each panel's legend is beside it, so it covers no line.

use std::path::Path;

use carve::WorkspaceMode;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::args::{plot_format, PlotFormat};
use crate::train::{mode_name, Run, Trace};
use crate::Res;

/// Width of the column right of each panel that holds its legend.
const LEGEND_WIDTH: u32 = 150;

fn series_color(mode: WorkspaceMode) -> RGBColor {
    match mode {
        WorkspaceMode::Enabled => RGBColor(31, 119, 180),
        WorkspaceMode::None => RGBColor(214, 39, 40),
    }
}

/// Registers DejaVu Sans (embedded by the `dejavu` crate) as plotters' "sans-serif",
/// so that text renders without system fonts or fontconfig.
fn register_fonts() -> Res<()> {
    for (style, bytes) in [(FontStyle::Normal, dejavu::sans::regular()), (FontStyle::Bold, dejavu::sans::bold())] {
        plotters::style::register_font("sans-serif", style, bytes)
            .map_err(|_| "the embedded DejaVu Sans font could not be loaded")?;
    }
    Ok(())
}

pub(crate) fn plot(path: &Path, runs: &[Run]) -> Res<()> {
    register_fonts()?;
    let size = (1200, 1000);
    let drawn = match plot_format(path) {
        Some(PlotFormat::Svg) => draw(SVGBackend::new(path, size).into_drawing_area(), runs),
        Some(PlotFormat::Png) => {
            let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
            draw(BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area(), runs)
                .and_then(|()| write_png(path, size, &rgb))
        }
        None => return Err(format!("--plot {}: use a .svg or .png file name", path.display()).into()),
    };
    drawn.map_err(|e| format!("drawing {}: {e}", path.display()).into())
}

/// Writes an 8-bit RGB image as a PNG file: the signature, an `IHDR` chunk, one
/// zlib-compressed `IDAT` chunk (each row prefixed by filter type 0) and `IEND`. Written
/// here with `flate2` (which the demo already uses for its data) rather than through an
/// image library, which would double the demo's cold build.
fn write_png(path: &Path, (width, height): (u32, u32), rgb: &[u8]) -> Res<()> {
    use std::io::Write;

    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut crc = flate2::Crc::new();
        crc.update(kind);
        crc.update(data);
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        out.extend_from_slice(&crc.sum().to_be_bytes());
    }

    let row = width as usize * 3;
    assert_eq!(rgb.len(), row * height as usize, "an RGB buffer of the image's size");
    let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    for line in rgb.chunks_exact(row) {
        zlib.write_all(&[0])?;
        zlib.write_all(line)?;
    }
    let mut header = Vec::with_capacity(13);
    header.extend_from_slice(&width.to_be_bytes());
    header.extend_from_slice(&height.to_be_bytes());
    header.extend_from_slice(&[8, 2, 0, 0, 0]); // 8 bits, RGB, deflate, no filter set, no interlace
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    chunk(&mut png, b"IHDR", &header);
    chunk(&mut png, b"IDAT", &zlib.finish()?);
    chunk(&mut png, b"IEND", &[]);
    std::fs::write(path, png).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// One panel: its caption, the y axis' unit and scale, and the series it draws.
struct Panel {
    caption: &'static str,
    unit: &'static str,
    scale: f64,
    pick: fn(&Trace) -> &[u64],
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, runs: &[Run]) -> Res<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled("carve train_digits: memory per training iteration", ("sans-serif", 24))?;
    let areas = root.split_evenly((3, 1));
    let iterations = runs.iter().map(|r| r.trace.loss.len()).max().unwrap_or(0).max(2);
    let panels = [
        Panel {
            caption: "workspace bytes in use (peak of each iteration)",
            unit: "KiB",
            scale: 1024.0,
            pick: |t| &t.workspace_bytes,
        },
        Panel {
            caption: "heap bytes in use (peak of each fit_batch)",
            unit: "KiB",
            scale: 1024.0,
            pick: |t| &t.heap_bytes,
        },
        Panel { caption: "heap allocations during fit_batch", unit: "allocations", scale: 1.0, pick: |t| &t.allocs },
    ];
    let top = |panels: &[Panel]| {
        let top = panels
            .iter()
            .flat_map(|p| runs.iter().flat_map(move |r| (p.pick)(&r.trace).iter().map(move |&v| v as f64 / p.scale)))
            .fold(0.0f64, f64::max);
        if top > 0.0 {
            top * 1.1
        } else {
            1.0
        }
    };
    // Workspace and heap bytes on one scale, so that the two modes' memory compares.
    let tops = [top(&panels[..2]), top(&panels[..2]), top(&panels[2..])];
    for ((area, panel), top) in areas.iter().zip(&panels).zip(tops) {
        let (chart_area, legend_area) = area.split_horizontally(area.dim_in_pixel().0.saturating_sub(LEGEND_WIDTH));
        let mut chart = ChartBuilder::on(&chart_area)
            .caption(panel.caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(0..iterations - 1, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc(panel.unit)
            .y_label_formatter(&|v| format!("{v:.0}"))
            .label_style(("sans-serif", 14))
            .draw()?;
        for run in runs {
            let color = series_color(run.mode);
            let points = (panel.pick)(&run.trace).iter().enumerate().map(|(i, &v)| (i, v as f64 / panel.scale));
            chart.draw_series(LineSeries::new(points, color.stroke_width(2)))?;
        }
        for (i, run) in runs.iter().enumerate() {
            let color = series_color(run.mode);
            let y = 60 + 28 * i as i32;
            legend_area.draw(&PathElement::new(vec![(8, y), (36, y)], color.stroke_width(3)))?;
            legend_area.draw(&Text::new(mode_name(run.mode), (44, y - 9), ("sans-serif", 16)))?;
        }
    }
    root.present()?;
    Ok(())
}
