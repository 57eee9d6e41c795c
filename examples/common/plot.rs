//! The plot of the training examples' `--plot`: per iteration of each mode, the
//! workspace bytes in use, the heap bytes in use (on the same scale: with workspaces
//! off the memory is on the heap) and the heap allocations. Each panel's legend is
//! beside it, so it covers no line. Shared by `train_digits` and `train_sequences`,
//! with the checks of the plot's path they make before training.

use std::path::{Path, PathBuf};

use carve::WorkspaceMode;
use plotters::coord::Shift;
use plotters::prelude::*;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One mode's measurements per training iteration.
pub(crate) struct Series<'a> {
    pub(crate) mode: WorkspaceMode,
    pub(crate) workspace_bytes: &'a [u64],
    pub(crate) heap_bytes: &'a [u64],
    pub(crate) allocs: &'a [u64],
}

fn mode_name(mode: WorkspaceMode) -> &'static str {
    mode.name()
}

/// The image formats of `--plot`, by file name extension.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PlotFormat {
    Svg,
    Png,
}

pub(crate) fn plot_format(path: &Path) -> Option<PlotFormat> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "svg" => Some(PlotFormat::Svg),
        "png" => Some(PlotFormat::Png),
        _ => None,
    }
}

/// The value parser of `--plot`: a path whose name ends in .svg or .png.
pub(crate) fn parse_plot_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match plot_format(&path) {
        Some(_) => Ok(path),
        None => Err(format!("'{s}' does not end in .svg or .png: the plot's format is taken from the file name")),
    }
}

/// Checks, before training, that the plot can be written to `path` (see
/// [`crate::cli::check_writable`]).
pub(crate) fn check_plot_path(path: &Path) -> Result<(), String> {
    crate::cli::check_writable(path, "--plot", "the plot")
}

/// Width of the column right of each panel that holds its legend.
const LEGEND_WIDTH: u32 = 150;

fn series_color(mode: WorkspaceMode) -> RGBColor {
    match mode {
        WorkspaceMode::Enabled => RGBColor(31, 119, 180),
        WorkspaceMode::Planned => RGBColor(44, 160, 44),
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

/// Draws `runs` to `path` (SVG or PNG, by its name) under `title`.
pub(crate) fn plot(path: &Path, title: &str, runs: &[Series<'_>]) -> Res<()> {
    register_fonts()?;
    let size = (1200, 1000);
    let drawn = match plot_format(path) {
        Some(PlotFormat::Svg) => draw(SVGBackend::new(path, size).into_drawing_area(), title, runs),
        Some(PlotFormat::Png) => {
            let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
            draw(BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area(), title, runs)
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
    pick: for<'s> fn(&'s Series<'_>) -> &'s [u64],
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, title: &str, runs: &[Series<'_>]) -> Res<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let areas = root.split_evenly((3, 1));
    let iterations = runs.iter().map(|r| r.allocs.len()).max().unwrap_or(0).max(2);
    let panels = [
        Panel {
            caption: "workspace bytes in use (peak of each iteration)",
            unit: "KiB",
            scale: 1024.0,
            pick: |s| s.workspace_bytes,
        },
        Panel {
            caption: "heap bytes in use (peak of each fit_batch)",
            unit: "KiB",
            scale: 1024.0,
            pick: |s| s.heap_bytes,
        },
        Panel { caption: "heap allocations during fit_batch", unit: "allocations", scale: 1.0, pick: |s| s.allocs },
    ];
    let top = |panels: &[Panel]| {
        let top = panels
            .iter()
            .flat_map(|p| runs.iter().flat_map(move |r| (p.pick)(r).iter().map(move |&v| v as f64 / p.scale)))
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
            let points = (panel.pick)(run).iter().enumerate().map(|(i, &v)| (i, v as f64 / panel.scale));
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
