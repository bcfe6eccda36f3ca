#include "common/text.h"

#include "common/atomic_file.h"

namespace qcal {

std::string NormalizeNewlines(std::string text) {
  size_t out = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\r') {
      text[out++] = '\n';
      if (i + 1 < text.size() && text[i + 1] == '\n') ++i;
    } else {
      text[out++] = text[i];
    }
  }
  text.resize(out);
  return text;
}

StatusOr<std::string> ReadTextFile(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return NormalizeNewlines(std::move(text));
}

}  // namespace qcal
