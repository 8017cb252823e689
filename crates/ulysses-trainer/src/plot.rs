//! The loss curve as a PNG.
//!
//! plotters renders text with a TrueType font that has to be registered at run time; the
//! plot uses DejaVu Sans when a system has it (Debian's `fonts-dejavu-core`) and is drawn
//! without labels otherwise.

use std::{path::Path, sync::OnceLock};

use plotters::prelude::*;

const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers a font once; false when none was found.
fn font_available() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        FONT_PATHS.iter().any(|path| {
            std::fs::read(path).is_ok_and(|bytes| {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            })
        })
    })
}

/// Draws training loss per step and evaluation loss at its steps (a marker at each: one
/// evaluation is a point) into `path`, a PNG written atomically (as the run's other files: a
/// crash leaves the last curve or this one); `unit`: what the loss is per (`token`, `byte`).
pub fn loss_curve(path: &Path, title: &str, unit: &str, train: &[(usize, f64)], eval: &[(usize, f64)]) -> Result<(), String> {
    let png = draw(title, unit, train, eval).map_err(|e| format!("cannot draw {}: {e}", path.display()))?;
    ulysses_training::checkpoint::write_atomically(path, &[&png]).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

const SIZE: (u32, u32) = (960, 600);

/// The curve as PNG bytes.
fn draw(title: &str, unit: &str, train: &[(usize, f64)], eval: &[(usize, f64)]) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    plot(&mut rgb, title, unit, train, eval)?;
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, SIZE.0, SIZE.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&rgb)?;
    writer.finish()?;
    Ok(png)
}

fn plot(rgb: &mut [u8], title: &str, unit: &str, train: &[(usize, f64)], eval: &[(usize, f64)]) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let last_step = train.iter().chain(eval).map(|p| p.0).max().unwrap_or(1).max(1);
    // Finite losses alone set the axis (an infinite held-out loss would leave it no top).
    let highest = train.iter().chain(eval).map(|p| p.1).filter(|v| v.is_finite()).fold(0.0, f64::max).max(1e-3) * 1.05;
    let labels = font_available();

    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if labels {
        builder.caption(title, ("sans-serif", 24)).x_label_area_size(45).y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(0..last_step, 0.0..highest)?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_desc("optimizer step").y_desc(format!("cross-entropy (nats / {unit})"));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw()?;

    let series = [("train", train, BLUE.stroke_width(2)), ("held-out", eval, RED.stroke_width(3))];
    for (name, points, style) in series {
        let drawn = chart.draw_series(LineSeries::new(points.iter().copied(), style))?;
        if labels {
            drawn.label(name).legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
    }
    // Evaluations are few: each a marker, so that a run evaluated once shows its point (a
    // line of one point draws nothing).
    chart.draw_series(eval.iter().filter(|p| p.1.is_finite()).map(|&point| Circle::new(point, 4, RED.filled())))?;
    if labels {
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Pixels of the held-out series' red in a plot of `eval` beside 30 steps of training.
    fn red_pixels(eval: &[(usize, f64)]) -> usize {
        let train: Vec<(usize, f64)> = (0..30).map(|step| (step, 5.0 - 0.1 * step as f64)).collect();
        let mut rgb = vec![0u8; super::SIZE.0 as usize * super::SIZE.1 as usize * 3];
        super::plot(&mut rgb, "run", "token", &train, eval).unwrap();
        rgb.chunks(3).filter(|pixel| pixel == &[255, 0, 0]).count()
    }

    /// A run evaluated once (`--steps 30` under the default `--eval-every 50`) shows its point:
    /// a line of one point draws nothing.
    #[test]
    fn a_single_held_out_loss_shows_as_a_point() {
        let (none, one) = (red_pixels(&[]), red_pixels(&[(29, 2.5)]));
        assert!(one > none + 20, "one held-out point drew {} red pixels", one.saturating_sub(none));
    }
}
