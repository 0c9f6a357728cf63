//! The benchmark as a picture: seconds per epoch, one line per method, written as SVG beside
//! the JSON. Drawn with `plotters`' SVG backend and its built-in font metrics, so it needs no
//! system font library and the text stays text (the viewer's font draws it).

use std::path::Path;

use plotters::prelude::*;

use super::report::Report;
use crate::files::write_atomically;

/// Pixels: wide enough for a dozen epochs' labels, small enough for a README.
const SIZE: (u32, u32) = (720, 420);
/// One colour per method, in [`super::Method::ALL`]'s order.
const COLOURS: [RGBColor; 4] = [
    RGBColor(204, 51, 17),
    RGBColor(0, 119, 187),
    RGBColor(238, 119, 51),
    RGBColor(0, 153, 136),
];

#[derive(Debug, thiserror::Error)]
#[error("cannot draw the chart {path}: {message}")]
pub struct ChartError {
    path: String,
    message: String,
}

/// Draws `report`'s epoch times into the SVG file `path`, written as the JSON is: a new file
/// renamed over `path`, so a link or a FIFO someone put there is replaced, never followed.
pub fn draw(report: &Report, path: &Path) -> Result<(), ChartError> {
    let fail = |message: String| ChartError {
        path: path.display().to_string(),
        message,
    };
    let svg = render(report).map_err(fail)?;
    write_atomically(path, svg.as_bytes(), 0o644).map_err(|e| fail(e.to_string()))
}

/// `report`'s epoch times as an SVG document.
fn render(report: &Report) -> Result<String, String> {
    let fail = |e: &dyn std::fmt::Display| e.to_string();
    let runs: Vec<_> = report
        .methods
        .iter()
        .filter(|(_, run)| !run.epochs.is_empty())
        .collect();
    let epochs = runs.iter().map(|(_, r)| r.epochs.len()).max().unwrap_or(0);
    let slowest = (runs.iter())
        .flat_map(|(_, r)| r.epochs.iter().map(|e| e.seconds))
        .fold(0.0, f64::max);
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    // A single epoch still gets an x range to draw in.
    let last = epochs.saturating_sub(1).max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption("seconds per epoch", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(-0.2..last + 0.2, 0.0..(slowest * 1.15).max(0.001))
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("seconds")
        .x_labels(epochs.max(2))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| fail(&e))?;
    for (method, run) in runs {
        let colour = COLOURS[method as usize];
        let points: Vec<(f64, f64)> = (run.epochs.iter().enumerate())
            .map(|(i, e)| (i as f64, e.seconds))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(method.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )
            .map_err(|e| fail(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    drop(chart);
    drop(root);
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::draw;
    use crate::bench::report::{Epoch, MethodRun, Methods, Report};

    #[test]
    fn one_line_per_method_that_ran() {
        let run = |seconds: &[f64]| MethodRun {
            epochs: seconds
                .iter()
                .map(|&seconds| Epoch {
                    seconds,
                    ..Epoch::default()
                })
                .collect(),
            ..MethodRun::default()
        };
        let report = Report {
            methods: Methods {
                direct: Some(run(&[3.0, 3.1, 2.9])),
                stagefs: Some(run(&[2.0, 0.5, 0.4])),
                stagefs_fuse: None,
                copy_first: Some(MethodRun {
                    skipped: Some("no room".into()),
                    ..MethodRun::default()
                }),
            },
            ..Report::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.svg");
        draw(&report, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        // A method's line is the only polyline drawn 2 px wide; its legend entry is text.
        let lines = svg
            .lines()
            .filter(|l| l.starts_with("<polyline") && l.contains(r#"stroke-width="2""#));
        assert_eq!(lines.count(), 2, "{svg}");
        assert!(
            svg.contains("\ndirect\n") && svg.contains("\nstagefs\n"),
            "{svg}"
        );
        assert!(!svg.contains("copy-first"), "{svg}");
    }
}
