#include "report/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"

namespace qcal::report {
namespace {

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Num(double v, int digits = 4) {
  if (!std::isfinite(v)) return "–";
  return absl::StrFormat("%.*g", digits, v);
}

std::string Bytes(int64_t b) {
  if (b < 0) return "–";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, units[u]);
}

double NumberOr(const nlohmann::json& j, const char* key, double fallback) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return fallback;
  return j[key].get<double>();
}

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

// ---- SVG plots -------------------------------------------------------------------------------

const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
const char* Color(size_t i) { return kPalette[i % (sizeof(kPalette) / sizeof(kPalette[0]))]; }

struct Series {
  std::string name;
  std::vector<double> x, y;  // NaN y: a gap
};

struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  double Map(double v, double a, double b) const {  // value -> pixel between a and b
    const double t = log ? (std::log10(v) - lo) / (hi - lo) : (v - lo) / (hi - lo);
    return a + t * (b - a);
  }
};

// Round tick values covering [lo, hi] (in log10 units for a log axis).
std::vector<double> Ticks(const Axis& ax) {
  std::vector<double> t;
  if (ax.log) {
    for (double e = std::floor(ax.lo); e <= std::ceil(ax.hi) + 1e-9; e += 1) {
      if (e >= ax.lo - 1e-9 && e <= ax.hi + 1e-9) t.push_back(std::pow(10.0, e));
    }
    if (t.size() < 3) {  // less than two decades: 1, 2, 5 of each decade
      t.clear();
      for (double e = std::floor(ax.lo); e <= std::ceil(ax.hi); e += 1) {
        for (double m : {1.0, 2.0, 5.0}) {
          const double v = m * std::pow(10.0, e);
          if (std::log10(v) >= ax.lo - 1e-9 && std::log10(v) <= ax.hi + 1e-9) t.push_back(v);
        }
      }
    }
    return t;
  }
  const double span = ax.hi - ax.lo;
  const double raw = span / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  }
  for (double v = std::ceil(ax.lo / step) * step; v <= ax.hi + step * 1e-9; v += step) {
    t.push_back(std::abs(v) < step * 1e-9 ? 0 : v);
  }
  return t;
}

Axis MakeAxis(double lo, double hi, bool log, bool from_zero) {
  Axis a;
  a.log = log;
  if (log) {
    lo = std::log10(lo);
    hi = std::log10(hi);
    if (hi - lo < 1e-9) {
      lo -= 0.5;
      hi += 0.5;
    }
    const double pad = (hi - lo) * 0.05;
    lo -= pad;
    hi += pad;
  } else {
    if (from_zero) lo = std::min(lo, 0.0);
    if (hi - lo < 1e-12) {
      hi = lo + (lo == 0 ? 1 : std::abs(lo) * 0.1);
    }
    const double pad = (hi - lo) * 0.05;
    if (!(from_zero && lo == 0)) lo -= pad;
    hi += pad;
  }
  a.lo = lo;
  a.hi = hi;
  return a;
}

constexpr int kW = 640, kPlotH = 225, kLeft = 70, kRight = 150, kTop = 30, kBottom = 45;

// `bottom`: the space under the plot area (ticks and the x label).
std::string Frame(const std::string& id, const std::string& title, const std::string& xlabel,
                  const std::string& ylabel, const Axis& x, const Axis& y, bool x_ticks,
                  int bottom = kBottom) {
  const int h = kTop + kPlotH + bottom;
  std::string s = absl::StrFormat(
      "<svg class=\"plot\" id=\"%s\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
      "height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"%s\">\n"
      "<text x=\"%d\" y=\"18\" class=\"title\">%s</text>\n",
      id, kW, h, kW, h, Escape(title), kLeft, Escape(title));
  const int x0 = kLeft, x1 = kW - kRight, y0 = kTop + kPlotH, y1 = kTop;
  absl::StrAppendFormat(&s, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" class=\"frame\"/>\n",
                        x0, y1, x1 - x0, y0 - y1);
  for (double t : Ticks(y)) {
    const double py = y.Map(t, y0, y1);
    absl::StrAppendFormat(&s,
                          "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>"
                          "<text x=\"%d\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%s</text>\n",
                          x0, x1, py, py, x0 - 4, py + 4, Num(t, 3));
  }
  if (x_ticks) {
    for (double t : Ticks(x)) {
      const double px = x.Map(t, x0, x1);
      absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%d\" class=\"tick\" "
                                "text-anchor=\"middle\">%s</text>\n",
                            px, y0 + 15, Num(t, 4));
    }
  }
  absl::StrAppendFormat(&s, "<text x=\"%d\" y=\"%d\" class=\"label\" text-anchor=\"middle\">%s</text>\n",
                        (x0 + x1) / 2, h - 8, Escape(xlabel));
  absl::StrAppendFormat(&s,
                        "<text transform=\"translate(14 %d) rotate(-90)\" class=\"label\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        (y0 + y1) / 2, Escape(ylabel));
  return s;
}

void Legend(std::string* s, const std::vector<std::string>& names) {
  for (size_t i = 0; i < names.size(); ++i) {
    const int y = kTop + 6 + static_cast<int>(i) * 16;
    absl::StrAppendFormat(s,
                          "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"10\" fill=\"%s\"/>"
                          "<text x=\"%d\" y=\"%d\" class=\"legend\">%s</text>\n",
                          kW - kRight + 10, y, Color(i), kW - kRight + 26, y + 9,
                          Escape(names[i]));
  }
}

// A line chart (markers on every point); `log_y` drops non-positive values. Empty string when
// no series has a finite point.
std::string LineChart(const std::string& id, const std::string& title, const std::string& xlabel,
                      const std::string& ylabel, const std::vector<Series>& series, bool log_y) {
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  auto usable = [log_y](double v) { return std::isfinite(v) && (!log_y || v > 0); };
  for (const Series& s : series) {
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.y[i])) continue;
      xlo = std::min(xlo, s.x[i]);
      xhi = std::max(xhi, s.x[i]);
      ylo = std::min(ylo, s.y[i]);
      yhi = std::max(yhi, s.y[i]);
    }
  }
  if (!std::isfinite(ylo)) return "";
  const Axis x = MakeAxis(xlo, xhi, false, false), y = MakeAxis(ylo, yhi, log_y, !log_y);
  std::string out = Frame(id, title, xlabel, ylabel, x, y, true);
  const int x0 = kLeft, x1 = kW - kRight, y0 = kTop + kPlotH, y1 = kTop;
  std::vector<std::string> names;
  for (size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    names.push_back(s.name);
    std::string d;
    bool pen = false;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.y[i])) {
        pen = false;
        continue;
      }
      const double px = x.Map(s.x[i], x0, x1), py = y.Map(s.y[i], y0, y1);
      absl::StrAppendFormat(&d, "%s%.1f %.1f ", pen ? "L" : "M", px, py);
      absl::StrAppendFormat(&out,
                            "<circle class=\"data\" cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\">"
                            "<title>%s: %s, %s</title></circle>\n",
                            px, py, Color(k), Escape(s.name), Num(s.x[i]), Num(s.y[i]));
      pen = true;
    }
    if (!d.empty()) {
      absl::StrAppendFormat(&out, "<path class=\"data\" d=\"%s\" stroke=\"%s\" fill=\"none\"/>\n",
                            d, Color(k));
    }
  }
  Legend(&out, names);
  out += "</svg>\n";
  return out;
}

// Grouped bars: values[s][c] is series s at category c.
std::string BarChart(const std::string& id, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<std::string>& categories,
                     const std::vector<std::string>& names,
                     const std::vector<std::vector<double>>& values, const std::string& unit) {
  double yhi = 0;
  bool any = false;
  for (const auto& v : values) {
    for (double d : v) {
      if (std::isfinite(d)) {
        yhi = std::max(yhi, d);
        any = true;
      }
    }
  }
  if (!any || categories.empty()) return "";
  const Axis x = MakeAxis(0, static_cast<double>(categories.size()), false, true);
  const Axis y = MakeAxis(0, yhi, false, true);
  // Labels that do not fit under their bar are slanted, with room made for them below.
  size_t longest = 0;
  for (const std::string& c : categories) longest = std::max(longest, c.size());
  const double slot = static_cast<double>(kW - kRight - kLeft) / categories.size();
  const bool rotate = static_cast<double>(longest) * 6.5 > slot;
  const int bottom = rotate ? kBottom + static_cast<int>(longest * 4.0) : kBottom;
  std::string out = Frame(id, title, xlabel, ylabel, x, y, false, bottom);
  const int x0 = kLeft, y0 = kTop + kPlotH, y1 = kTop;
  const double bar = slot * 0.8 / std::max<size_t>(1, values.size());
  for (size_t c = 0; c < categories.size(); ++c) {
    const double cx = x0 + slot * (c + 0.5);
    if (rotate) {
      absl::StrAppendFormat(&out,
                            "<text transform=\"translate(%.1f %d) rotate(-35)\" class=\"tick\" "
                            "text-anchor=\"end\">%s</text>\n",
                            cx, y0 + 12, Escape(categories[c]));
    } else {
      absl::StrAppendFormat(&out, "<text x=\"%.1f\" y=\"%d\" class=\"tick\" "
                                  "text-anchor=\"middle\">%s</text>\n",
                            cx, y0 + 15, Escape(categories[c]));
    }
    for (size_t s = 0; s < values.size(); ++s) {
      const double v = c < values[s].size() ? values[s][c] : kNan;
      if (!std::isfinite(v)) continue;
      const double top = y.Map(v, y0, y1);
      const double bx = x0 + slot * c + slot * 0.1 + bar * s;
      absl::StrAppendFormat(&out,
                            "<rect class=\"data\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" "
                            "height=\"%.1f\" fill=\"%s\"><title>%s %s: %s%s</title></rect>\n",
                            bx, top, std::max(bar - 1, 1.0), std::max(y0 - top, 1.0), Color(s),
                            Escape(categories[c]), Escape(names[s]), Num(v), unit);
    }
  }
  Legend(&out, names);
  out += "</svg>\n";
  return out;
}

// ---- The journal ------------------------------------------------------------------------------

struct Journal {
  nlohmann::json start;                     // the last job_start
  std::map<int64_t, nlohmann::json> blocks;  // the latest block_done of each layer
  nlohmann::json e2e;                       // the last e2e_done (null: none)
  // The latest phase_done of each global phase that trained, in the order they first appear.
  std::vector<std::pair<std::string, nlohmann::json>> phases;
  nlohmann::json expert_load;  // the last expert_load (null: a dense model's job)
  // A MoE block split over tasks: its expert groups' block_part_done, the last per expert range.
  std::map<int64_t, std::map<std::pair<int64_t, int64_t>, nlohmann::json>> parts;
  bool done = false;
};

// The journal entries of finished block `layer`'s tasks: its block_done `b`, and for a MoE block
// split over tasks its expert groups' (their time and memory count for the block; their metrics
// are in `b` already).
std::vector<const nlohmann::json*> BlockTasks(const Journal& j, int64_t layer,
                                              const nlohmann::json& b) {
  std::vector<const nlohmann::json*> tasks = {&b};
  auto it = j.parts.find(layer);
  if (it != j.parts.end()) {
    for (const auto& [range, e] : it->second) tasks.push_back(&e);
  }
  return tasks;
}

StatusOr<Journal> ReadJournal(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  Journal j;
  std::istringstream in(text);
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    nlohmann::json e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (e.is_discarded() || !e.is_object()) {
      // The last line may be a torn append (the journal's readers skip it); others are errors.
      if (in.peek() == EOF) break;
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", n, " is not a JSON object"));
    }
    const std::string event = e.value("event", "");
    if (event == "job_start") {
      j.start = e;
      j.done = false;
    } else if (event == "block_done") {
      j.blocks[e.value("layer", int64_t{-1})] = e;
    } else if (event == "block_part_done") {
      const nlohmann::json part = e.value("part", nlohmann::json::object());
      if (!part.is_object()) continue;
      j.parts[e.value("layer", int64_t{-1})][{part.value("expert_begin", int64_t{-1}),
                                               part.value("expert_end", int64_t{-1})}] = e;
    } else if (event == "e2e_done") {
      j.e2e = e;
    } else if (event == "job_done") {
      j.done = true;
    } else if (event == "expert_load") {
      j.expert_load = e;
    } else if (event == "phase_done") {
      if (!e.contains("phase") || !e["phase"].is_string()) continue;
      const std::string phase = e["phase"].get<std::string>();
      auto it = std::find_if(j.phases.begin(), j.phases.end(),
                             [&](const auto& p) { return p.first == phase; });
      if (it == j.phases.end()) {
        j.phases.emplace_back(phase, e);
      } else {
        it->second = e;
      }
    }
  }
  if (j.start.is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no job_start entry"));
  }
  return j;
}

// A global phase's training curve: its phase_done entry's "losses" (one per step) and
// "validation" ([step, loss] pairs).
struct Training {
  std::string phase;
  std::vector<double> losses;
  std::vector<double> val_step, val_loss;
};

std::vector<Training> TrainingsOf(const Journal& j) {
  std::vector<Training> out;
  for (const auto& [phase, e] : j.phases) {
    Training t;
    t.phase = phase;
    const nlohmann::json none = nlohmann::json::array();
    const nlohmann::json& losses =
        e.contains("losses") && e["losses"].is_array() ? e["losses"] : none;
    const nlohmann::json& validation =
        e.contains("validation") && e["validation"].is_array() ? e["validation"] : none;
    for (const auto& v : losses) t.losses.push_back(v.is_number() ? v.get<double>() : kNan);
    for (const auto& p : validation) {
      if (!p.is_array() || p.size() != 2 || !p[0].is_number()) continue;
      t.val_step.push_back(p[0].get<double>());
      t.val_loss.push_back(p[1].is_number() ? p[1].get<double>() : kNan);
    }
    if (t.losses.empty() && t.val_step.empty()) continue;
    out.push_back(std::move(t));
  }
  return out;
}

std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::string s = "<table>\n";
  for (size_t r = 0; r < rows.size(); ++r) {
    s += "<tr>";
    for (const std::string& c : rows[r]) {
      absl::StrAppend(&s, r == 0 ? "<th>" : "<td>", c, r == 0 ? "</th>" : "</td>");
    }
    s += "</tr>\n";
  }
  return s + "</table>\n";
}

const char kStyle[] = R"(<style>
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
th { background: #f3f3f3; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
svg.plot { border: 1px solid #ddd; background: #fff; }
svg .title { font-size: 14px; font-weight: bold; }
svg .tick, svg .legend { font-size: 11px; } svg .label { font-size: 12px; }
svg .frame { fill: none; stroke: #999; } svg .grid { stroke: #eee; }
svg path.data { stroke-width: 1.6; }
.note { color: #666; font-size: 13px; }
</style>
)";

// What a browser checks (tests/report/report_test.sh): every plot's data marks have a non-empty
// box after layout; the result goes into <body data-plot-check="...">.
const char kCheck[] = R"(<script>
window.addEventListener('load', function () {
  var out = [];
  document.querySelectorAll('svg.plot').forEach(function (svg) {
    var marks = svg.querySelectorAll('.data'), shown = 0;
    marks.forEach(function (m) { var b = m.getBBox(); if (b.width > 0 || b.height > 0) shown++; });
    out.push(svg.id + ':' + marks.length + ':' + shown);
  });
  document.body.setAttribute('data-plot-check', out.join(' '));
});
</script>
)";

// ---- Routing (mixture-of-experts models) -------------------------------------------------------

// The journal's expert_load entry as a section: the tokens per expert of each MoE layer (the
// fewest, median and most, and the even share), a layers × experts map of each expert's share
// (red: no token; darker: more), and the experts calibrated on every token. Empty for an entry
// without layers.
std::string ExpertLoadSection(const nlohmann::json& entry) {
  struct Layer {
    int64_t layer = 0;
    std::vector<double> tokens;
    std::vector<int64_t> every_token;
  };
  if (!entry.is_object() || !entry.contains("layers") || !entry["layers"].is_array()) return "";
  std::vector<Layer> layers;
  for (const auto& l : entry["layers"]) {
    if (!l.is_object() || !l.contains("routed_tokens") || !l["routed_tokens"].is_array()) continue;
    Layer x;
    x.layer = static_cast<int64_t>(NumberOr(l, "layer", -1));
    for (const auto& t : l["routed_tokens"]) {
      x.tokens.push_back(t.is_number() ? t.get<double>() : kNan);
    }
    for (const auto& e : l.value("every_token", nlohmann::json::array())) {
      if (e.is_number_integer()) x.every_token.push_back(e.get<int64_t>());
    }
    if (!x.tokens.empty()) layers.push_back(std::move(x));
  }
  if (layers.empty()) return "";
  std::string html = "<h2>Routing: calibration tokens per expert</h2>\n<div class=\"plots\">\n";
  Series lo{"fewest", {}, {}}, mid{"median", {}, {}}, hi{"most", {}, {}};
  Series even{"even share", {}, {}};
  size_t experts = 0;
  for (const Layer& l : layers) {
    std::vector<double> t = l.tokens;
    std::sort(t.begin(), t.end());
    double sum = 0;
    for (double v : t) sum += v;
    const double x = static_cast<double>(l.layer);
    lo.x.push_back(x), lo.y.push_back(t.front());
    mid.x.push_back(x), mid.y.push_back(t[t.size() / 2]);
    hi.x.push_back(x), hi.y.push_back(t.back());
    even.x.push_back(x), even.y.push_back(sum / t.size());
    experts = std::max(experts, t.size());
  }
  html += LineChart("expert-load", "Tokens per expert by MoE layer", "layer",
                    "calibration tokens routed", {lo, mid, hi, even}, false);
  // The map: one row per MoE layer, one column per expert.
  const int x0 = kLeft, x1 = kW - kRight, y1 = kTop, y0 = kTop + kPlotH;
  const double cw = static_cast<double>(x1 - x0) / experts;
  const double ch = static_cast<double>(y0 - y1) / layers.size();
  // Unpadded axes: cell e spans [e, e + 1).
  Axis ex, ly;
  ex.hi = static_cast<double>(experts);
  ly.hi = static_cast<double>(layers.size());
  std::string map = Frame("expert-map", "Each expert's share (tokens ÷ even share)",
                          "expert", "MoE layers in order (first at the bottom)", ex, ly, true);
  for (size_t r = 0; r < layers.size(); ++r) {
    const Layer& l = layers[r];
    double sum = 0;
    for (double v : l.tokens) sum += v;
    const double share = sum / l.tokens.size();
    for (size_t e = 0; e < l.tokens.size(); ++e) {
      const double ratio = share > 0 ? l.tokens[e] / share : 0;
      std::string fill = "#d62728";  // no token
      if (ratio > 0) {
        const double t = std::min(1.0, ratio / 2);  // white .. dark blue at twice the share
        fill = absl::StrFormat("#%02x%02x%02x", static_cast<int>(247 - t * (247 - 8)),
                               static_cast<int>(251 - t * (251 - 48)),
                               static_cast<int>(255 - t * (255 - 107)));
      }
      const bool all = std::find(l.every_token.begin(), l.every_token.end(),
                                 static_cast<int64_t>(e)) != l.every_token.end();
      absl::StrAppendFormat(
          &map,
          "<rect class=\"data\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" "
          "fill=\"%s\"%s><title>layer %d expert %d: %s tokens (%s× the even share)%s</title>"
          "</rect>\n",
          x0 + cw * e, y0 - ch * (r + 1), cw, ch, fill,
          all ? " stroke=\"#000\" stroke-width=\"1\"" : "", l.layer, static_cast<int64_t>(e),
          Num(l.tokens[e], 8), Num(ratio, 3), all ? "; calibrated on every token" : "");
    }
  }
  Legend(&map, {});
  map += "</svg>\n";
  html += map + "</div>\n";
  std::vector<std::vector<std::string>> rows = {{"layer", "experts calibrated on every token"}};
  for (const Layer& l : layers) {
    if (l.every_token.empty()) continue;
    std::vector<std::string> names;
    for (int64_t e : l.every_token) {
      names.push_back(absl::StrCat(e, " (", Num(e < static_cast<int64_t>(l.tokens.size())
                                                     ? l.tokens[e] : kNan, 8), " routed)"));
    }
    rows.push_back({absl::StrCat(l.layer), absl::StrJoin(names, ", ")});
  }
  if (rows.size() > 1) {
    html += "<p class=\"note\">Experts calibrated on every token (the recipe's "
            "<code>moe_route_all</code>, or fewer routed tokens than <code>moe_min_tokens</code>;"
            " outlined in the map):</p>\n";
    html += Table(rows);
  }
  return html;
}

}  // namespace

StatusOr<JournaledJob> ReadJournaledJob(const std::string& journal) {
  QCAL_ASSIGN_OR_RETURN(Journal j, ReadJournal(journal));
  return JournaledJob{j.start.value("model", ""), j.start.value("out", "")};
}

StatusOr<std::string> RenderReport(const ReportInputs& inputs) {
  QCAL_ASSIGN_OR_RETURN(Journal j, ReadJournal(inputs.journal));
  const std::string recipe = j.start.value("recipe", "?");
  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>qcal report: ",
      Escape(recipe), "</title>\n", kStyle, "</head>\n<body>\n<h1>qcal job report: ",
      Escape(recipe), "</h1>\n");

  // Summary.
  double block_seconds = 0, code_bits = 0, stored_bits = 0;
  int64_t linears = 0, peak_host = -1, peak_device = -1;
  for (const auto& [layer, b] : j.blocks) {
    for (const auto& m : b.value("metrics", nlohmann::json::array())) {
      code_bits += NumberOr(m, "code_bits", 0);
      stored_bits += NumberOr(m, "stored_bits", 0);
      ++linears;
    }
    for (const nlohmann::json* t : BlockTasks(j, layer, b)) {
      block_seconds += NumberOr(*t, "seconds", 0);
      for (const auto& p : t->value("phases", nlohmann::json::array())) {
        peak_host =
            std::max<int64_t>(peak_host, static_cast<int64_t>(NumberOr(p, "peak_host_bytes", -1)));
        peak_device = std::max<int64_t>(
            peak_device, static_cast<int64_t>(NumberOr(p, "peak_device_bytes", -1)));
      }
    }
  }
  std::vector<std::vector<std::string>> summary = {
      {"", "value"},
      {"recipe", Escape(recipe)},
      {"model", Escape(j.start.value("model", ""))},
      {"output", Escape(inputs.out_dir.empty() ? j.start.value("out", "") : inputs.out_dir)},
      {"state", j.done ? "finished"
                       : absl::StrCat("in progress (", j.blocks.size(), " blocks journaled)")},
      {"blocks journaled", absl::StrCat(j.blocks.size())},
      {"block task seconds (sum)", Num(block_seconds)},
      {"bits per weight (codes / stored)",
       linears ? absl::StrCat(Num(code_bits / linears), " / ", Num(stored_bits / linears)) : "–"},
      {"peak host memory of a block task", Bytes(peak_host)},
      {"peak device memory of a block task", peak_device >= 0 ? Bytes(peak_device) : "– (CPU)"}};
  if (!j.e2e.is_null()) {
    summary.push_back({"end-to-end fine-tuning: held-out KL before → after (nats/token)",
                       absl::StrCat(Num(NumberOr(j.e2e, "kl_before", kNan)), " → ",
                                    Num(NumberOr(j.e2e, "kl_after", kNan)))});
  }
  html += "<h2>Job</h2>\n";
  html += Table(summary);

  // Perplexity and KL.
  html += "<h2>Perplexity and KL against the float model</h2>\n";
  if (inputs.evals.empty()) {
    html += "<p class=\"note\">Not measured for this report: <code>qcal report DIR --eval "
            "TEXT</code> measures them.</p>\n";
  } else {
    std::vector<std::vector<std::string>> t = {
        {"text", "ctx", "tokens scored", "float ppl", "quantized ppl", "ratio", "KL (nats/token)"}};
    for (const EvalRow& e : inputs.evals) {
      t.push_back({Escape(e.label), absl::StrCat(e.ctx), absl::StrCat(e.tokens_scored),
                   Num(e.float_perplexity, 6), Num(e.quantized_perplexity, 6),
                   Num(e.quantized_perplexity / e.float_perplexity, 5), Num(e.mean_kl, 4)});
    }
    html += Table(t);
  }

  html += ExpertLoadSection(j.expert_load);

  html += "<h2>Rounding and fine-tuning</h2>\n<div class=\"plots\">\n";
  std::vector<std::string> notes;
  // Per-layer proxy loss by linear: relative when measured, else absolute.
  {
    std::map<std::string, Series> by_linear;
    std::vector<std::string> order;
    bool relative = false;
    for (const auto& [layer, b] : j.blocks) {
      for (const auto& m : b.value("metrics", nlohmann::json::array())) {
        if (std::isfinite(NumberOr(m, "relative", kNan))) relative = true;
      }
    }
    const char* key = relative ? "relative" : "proxy_loss";
    for (const auto& [layer, b] : j.blocks) {
      // A MoE block's routed experts ("experts.<e>.<linear>", hundreds of them) are drawn as
      // the mean over experts of each linear and the worst expert linear of the block.
      std::map<std::string, std::pair<double, int64_t>> expert_mean;
      double worst = kNan;
      for (const auto& m : b.value("metrics", nlohmann::json::array())) {
        const std::string name = m.value("name", "?");
        const double v = NumberOr(m, key, kNan);
        if (name.rfind("experts.", 0) == 0) {
          // "experts.<e>.down_proj" -> "experts down (mean)" (the legend's width).
          const size_t dot = name.find('.', 8);
          std::string linear = dot == std::string::npos ? "?" : name.substr(dot + 1);
          if (linear.size() > 5 && linear.compare(linear.size() - 5, 5, "_proj") == 0) {
            linear.resize(linear.size() - 5);
          }
          auto& [sum, n] = expert_mean[absl::StrCat("experts ", linear, " (mean)")];
          if (std::isfinite(v)) {
            sum += v;
            ++n;
            worst = std::isfinite(worst) ? std::max(worst, v) : v;
          }
          continue;
        }
        if (!by_linear.count(name)) order.push_back(name);
        Series& s = by_linear[name];
        s.name = name;
        s.x.push_back(static_cast<double>(layer));
        s.y.push_back(v);
      }
      if (expert_mean.empty()) continue;
      expert_mean["experts: worst"] = {worst, 1};
      for (const auto& [name, sum_n] : expert_mean) {
        if (!by_linear.count(name)) order.push_back(name);
        Series& s = by_linear[name];
        s.name = name;
        s.x.push_back(static_cast<double>(layer));
        s.y.push_back(sum_n.second > 0 ? sum_n.first / sum_n.second : kNan);
      }
    }
    std::vector<Series> series;
    for (const std::string& n : order) series.push_back(by_linear[n]);
    const std::string chart = LineChart(
        "proxy-loss", relative ? "Relative proxy loss by linear" : "Proxy loss by linear",
        "layer", relative ? "tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)" : "tr(ΔW H ΔWᵀ)", series, true);
    if (chart.empty()) {
      notes.push_back("No proxy loss: the recipe rounds to nearest, without Hessians.");
    }
    html += chart;
  }
  // Block output error before / after fine-tuning.
  {
    Series before{"before fine-tuning", {}, {}}, after{"after fine-tuning", {}, {}};
    for (const auto& [layer, b] : j.blocks) {
      before.x.push_back(static_cast<double>(layer));
      before.y.push_back(NumberOr(b, "mse_before_ft", kNan));
      after.x.push_back(static_cast<double>(layer));
      after.y.push_back(NumberOr(b, "mse_after_ft", kNan));
    }
    const std::string chart =
        LineChart("block-mse", "Block output error (held-out MSE)", "layer",
                  "MSE against the float block", {before, after}, true);
    if (chart.empty()) notes.push_back("No within-block fine-tuning in this recipe.");
    html += chart;
  }
  // Fine-tuning curves: held-out MSE per epoch, one series per block (groups concatenated).
  {
    std::vector<Series> heldout, train;
    for (const auto& [layer, b] : j.blocks) {
      if (!b.contains("ft_curves") || !b["ft_curves"].is_array()) continue;
      Series h{absl::StrCat("block ", layer), {}, {}}, t{absl::StrCat("block ", layer), {}, {}};
      double at = 0;
      for (const auto& c : b["ft_curves"]) {
        const auto& hv = c.value("heldout", nlohmann::json::array());
        const auto& tv = c.value("train", nlohmann::json::array());
        for (size_t e = 0; e < hv.size(); ++e) {
          h.x.push_back(at + e);
          h.y.push_back(hv[e].is_number() ? hv[e].get<double>() : kNan);
        }
        for (size_t e = 0; e < tv.size(); ++e) {
          t.x.push_back(at + e + 1);
          t.y.push_back(tv[e].is_number() ? tv[e].get<double>() : kNan);
        }
        at += static_cast<double>(hv.size());
        h.x.push_back(at);  // a gap between groups
        h.y.push_back(kNan);
        t.x.push_back(at);
        t.y.push_back(kNan);
      }
      heldout.push_back(std::move(h));
      train.push_back(std::move(t));
    }
    html += LineChart("ft-heldout", "Fine-tuning: held-out loss per epoch",
                      "epoch (groups of linears one after another)", "block output MSE", heldout,
                      true);
    html += LineChart("ft-train", "Fine-tuning: training loss per epoch",
                      "epoch (groups of linears one after another)", "mean batch MSE", train, true);
  }
  // Global phases that trained (the journal's phase_done entries), by the phase's name.
  for (const Training& t : TrainingsOf(j)) {
    Series loss{"training loss", {}, t.losses};
    for (size_t i = 0; i < t.losses.size(); ++i) loss.x.push_back(static_cast<double>(i + 1));
    std::vector<Series> s = {loss};
    if (!t.val_step.empty()) s.push_back({"held-out loss", t.val_step, t.val_loss});
    html += LineChart(absl::StrCat("training-", t.phase),
                      absl::StrCat("Training in the '", t.phase, "' phase"), "step", "loss", s,
                      false);
  }
  html += "</div>\n";
  for (const std::string& n : notes) absl::StrAppend(&html, "<p class=\"note\">", n, "</p>\n");

  // Time and memory.
  html += "<h2>Time and memory</h2>\n<div class=\"plots\">\n";
  {
    std::vector<std::string> phases;
    std::map<std::string, double> seconds;
    for (const auto& [layer, b] : j.blocks) {
      for (const nlohmann::json* t : BlockTasks(j, layer, b)) {
        for (const auto& p : t->value("phases", nlohmann::json::array())) {
          const std::string name = p.value("name", "?");
          if (!seconds.count(name)) phases.push_back(name);
          seconds[name] += NumberOr(p, "seconds", 0);
        }
      }
    }
    std::vector<double> v;
    for (const std::string& p : phases) v.push_back(seconds[p]);
    html += BarChart("time-phase", "Time per phase (summed over blocks)", "phase", "seconds",
                     phases, {"seconds"}, {v}, " s");
    std::vector<std::string> layers;
    std::vector<double> per_block;
    for (const auto& [layer, b] : j.blocks) {
      layers.push_back(absl::StrCat(layer));
      double seconds = NumberOr(b, "seconds", kNan);  // a split block: its tasks summed
      for (const nlohmann::json* t : BlockTasks(j, layer, b)) {
        if (t != &b) seconds += NumberOr(*t, "seconds", 0);
      }
      per_block.push_back(seconds);
    }
    html += BarChart("time-block", "Time per block task", "layer", "seconds", layers,
                     {"seconds"}, {per_block}, " s");
    // Peak memory per rank: the largest peak over the rank's block tasks.
    std::map<int64_t, std::pair<int64_t, int64_t>> ranks;  // rank -> (host, device)
    for (const auto& [layer, b] : j.blocks) {
      for (const nlohmann::json* t : BlockTasks(j, layer, b)) {
        const int64_t rank = static_cast<int64_t>(NumberOr(*t, "rank", 0));
        auto& r = ranks.emplace(rank, std::make_pair(int64_t{-1}, int64_t{-1})).first->second;
        for (const auto& p : t->value("phases", nlohmann::json::array())) {
          r.first = std::max<int64_t>(
              r.first, static_cast<int64_t>(NumberOr(p, "peak_host_bytes", -1)));
          r.second = std::max<int64_t>(
              r.second, static_cast<int64_t>(NumberOr(p, "peak_device_bytes", -1)));
        }
      }
    }
    std::vector<std::string> rank_names;
    std::vector<double> host, device;
    bool any_device = false;
    for (const auto& [rank, peaks] : ranks) {
      rank_names.push_back(absl::StrCat("rank ", rank));
      host.push_back(peaks.first >= 0 ? peaks.first / 1048576.0 : kNan);
      device.push_back(peaks.second >= 0 ? peaks.second / 1048576.0 : kNan);
      any_device = any_device || peaks.second >= 0;
    }
    std::vector<std::string> names = {"host (resident)"};
    std::vector<std::vector<double>> values = {host};
    if (any_device) {
      names.push_back("device");
      values.push_back(device);
    }
    html += BarChart("memory-rank", "Peak memory per rank (its block tasks)", "rank", "MiB",
                     rank_names, names, values, " MiB");
  }
  html += "</div>\n";
  html += kCheck;
  html += "</body></html>\n";
  return html;
}

Status WriteReport(const ReportInputs& inputs, const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string html, RenderReport(inputs));
  return WriteFileAtomic(path, html);
}

}  // namespace qcal::report
